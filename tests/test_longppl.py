"""LongPPL: sliding-window short contexts and key tokens vs a brute-force reading of the definition."""

import collections
import math
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from callbacks.longppl import (
    first_short_index,
    full_context_logprobs,
    key_spans,
    key_token_mask,
    longppl,
    longppl_from_logprobs,
    short_context_logprobs,
    sliding_window_short_logprobs,
    tokens_in_spans,
)
from tests.tiny_models import VOCAB, TinyCausalLM, brute_force_logprobs

T, K = 41, 8


def threshold_between(values: torch.Tensor) -> float:
    """A threshold halfway between two neighbouring middle values, so a rounding error cannot flip a token."""
    ordered = values.sort().values
    middle = ordered.numel() // 2
    return ((ordered[middle - 1] + ordered[middle]) / 2).item()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def evaluator() -> TinyCausalLM:
    return TinyCausalLM(seed=0)


@pytest.fixture(scope="module")
def evaluated() -> TinyCausalLM:
    return TinyCausalLM(seed=1)


@pytest.mark.parametrize("d", [1, 3, 12])
def test_short_context_logprobs_match_one_forward_per_token(evaluator, tokens, d):
    _, expected, has_short = brute_force_logprobs(evaluator, tokens, K, d)
    got = short_context_logprobs(evaluator, tokens, K, d, batch_size=4)
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert has_short.nonzero()[0].item() == first_short_index(K, d)


@pytest.mark.parametrize("d", [1, 3])
def test_longppl_matches_brute_force_definition(evaluator, evaluated, tokens, d):
    long, short, has_short = brute_force_logprobs(evaluator, tokens, K, d)
    alpha, beta = threshold_between((long - short)[has_short]), threshold_between(long[has_short])
    expected_key = has_short & (long - short > alpha) & (long > beta)
    evaluated_long, _, _ = brute_force_logprobs(evaluated, tokens, K, d)

    result = longppl(evaluated, evaluator, tokens, K, d, alpha, beta, batch_size=4)

    assert torch.equal(result.key_mask, expected_key)
    assert 0 < result.n_key < int(has_short.sum())
    torch.testing.assert_close(
        result.longppl, (-evaluated_long[expected_key]).mean().exp().item(), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(result.ppl, (-evaluated_long[1:]).mean().exp().item(), rtol=1e-5, atol=0)
    assert result.n_tokens == T - 1


def test_unbounded_thresholds_give_ppl_over_tokens_with_short_context(evaluator, evaluated, tokens):
    d = 3
    start = first_short_index(K, d)
    result = longppl(evaluated, evaluator, tokens, K, d, alpha=-math.inf, beta=-math.inf)
    expected = (-full_context_logprobs(evaluated, tokens)[start:]).mean().exp().item()
    assert result.n_key == T - start
    torch.testing.assert_close(result.longppl, expected, rtol=1e-5, atol=0)


def test_precomputed_logprobs_and_key_mask_give_the_same_result(evaluator, evaluated, tokens):
    direct = longppl(evaluated, evaluator, tokens, K, 3, alpha=0.0, beta=-4.0)
    mask = key_token_mask(evaluator, tokens, K, 3, alpha=0.0, beta=-4.0)
    cached = longppl(None, None, tokens, logprobs=full_context_logprobs(evaluated, tokens), key_mask=mask)
    assert torch.equal(cached.key_mask, direct.key_mask) and 0 < cached.n_key < T
    assert (cached.longppl, cached.ppl, cached.n_key) == (direct.longppl, direct.ppl, direct.n_key)
    with pytest.raises(ValueError, match="evaluator_logits_fn or a precomputed key_mask"):
        longppl(evaluated, None, tokens, K, 3)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batched_rows_share_forwards_and_match_single_rows(evaluator, tokens, padding_side):
    d, batch_size, lengths = 3, 4, [T, 30, 20, 9]
    rows, masks = [], []
    for length in lengths:
        pad = torch.full((T - length,), 7)
        real = tokens[-length:]
        rows.append(torch.cat([real, pad] if padding_side == "right" else [pad, real]))
        masks.append(torch.arange(T) < length if padding_side == "right" else torch.arange(T) >= T - length)
    input_ids, mask = torch.stack(rows), torch.stack(masks)
    calls = collections.Counter()  # window length -> windows run

    def counting_logits_fn(ids: torch.Tensor) -> torch.Tensor:
        assert len(ids) <= batch_size
        calls[ids.shape[1]] += len(ids)
        return evaluator(ids)

    short, has_short = sliding_window_short_logprobs(counting_logits_fn, input_ids, mask, K, d, batch_size)

    expected_calls = collections.Counter()  # full windows: K + d - 1 tokens; a partial last block: K + n - 1
    for n in lengths:
        if n > (start := first_short_index(K, d)):
            expected_calls[K + d - 1] += (n - start) // d
            expected_calls[K + (n - start) % d - 1] += (n - start) % d > 0
    assert calls == +expected_calls and len(calls) > 1
    for row, length in enumerate(lengths):
        expected = short_context_logprobs(evaluator, tokens[-length:], K, d)
        expected_has = torch.arange(length) >= first_short_index(K, d)
        torch.testing.assert_close(short[row][mask[row]][expected_has], expected[expected_has])
        assert torch.equal(has_short[row][mask[row]], expected_has)
        assert not has_short[row][~mask[row]].any()
    repadded, _ = sliding_window_short_logprobs(evaluator, input_ids.masked_fill(~mask, 3), mask, K, d)
    torch.testing.assert_close(repadded, short, equal_nan=True)


def char_offsets(text: str) -> list[tuple[int, int]]:
    """A character-level tokenizer: one token per non-space character."""
    return [(i, i + 1) for i, char in enumerate(text) if not char.isspace()]


def test_words_inside_key_character_spans_are_key():
    text = "the cat sat on the mat"
    key_chars = {4, 5, 6, 8, 21}  # "cat", the "s" of "sat", the "t" of "mat"
    chars = char_offsets(text)
    spans = key_spans(torch.tensor([start in key_chars for start, _ in chars]), chars)
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
    assert spans == [(4, 7), (8, 9), (21, 22)]
    assert tokens_in_spans(words, spans).tolist() == [False, True, False, False, False, False]


def trained_tokenizer(model: models.Model, trainer: trainers.Trainer, corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def test_cross_tokenizer_matching_equals_character_containment():
    corpus = [
        "the quick brown fox jumps over the lazy dog while the other fox sleeps near the quiet barn"
    ] * 4
    text = "the lazy fox jumps near the quick dog, then the brown fox sleeps over the barn"
    evaluator_tok = trained_tokenizer(
        models.BPE(unk_token="[UNK]"), trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]), corpus
    )
    evaluated_tok = trained_tokenizer(
        models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer(special_tokens=["[UNK]"]), corpus
    )
    evaluator_offsets = evaluator_tok.encode(text).offsets
    evaluated_offsets = evaluated_tok.encode(text).offsets
    assert len(evaluator_offsets) > len(evaluated_offsets)  # genuinely different tokenizations
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        key_mask = torch.rand(len(evaluator_offsets), generator=generator) < 0.6
        key_chars = {
            c for (s, e), key in zip(evaluator_offsets, key_mask, strict=True) if key for c in range(s, e)
        }
        expected = [e > s and set(range(s, e)) <= key_chars for s, e in evaluated_offsets]
        got = tokens_in_spans(evaluated_offsets, key_spans(key_mask, evaluator_offsets))
        assert got.tolist() == expected


def test_bad_inputs_name_the_problem(evaluator, tokens):
    with pytest.raises(ValueError, match="1-D LongTensor"):
        short_context_logprobs(evaluator, tokens[None], K, 3)
    with pytest.raises(ValueError, match="K >= 1"):
        short_context_logprobs(evaluator, tokens, 0, 3)
    with pytest.raises(ValueError, match=r"logits \(B, T, V\)"):
        full_context_logprobs(lambda ids: evaluator(ids)[0], tokens)
    with pytest.raises(ValueError, match="token 0 has no prediction"):
        longppl_from_logprobs(torch.zeros(T), torch.ones(T, dtype=torch.bool))
