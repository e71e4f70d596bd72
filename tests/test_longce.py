"""LongCE: unit weights give CE, weights carry no gradient, padding is ignored, batch loss vs brute force."""

import math

import pytest
import torch
import torch.nn.functional as F

from callbacks.longppl import first_short_index, token_logprobs
from losses.ce import CrossEntropy
from losses.longce import (
    LongCE,
    longce_loss,
    longce_loss_for_batch,
    longce_weights,
    sliding_window_short_logprobs,
)
from models import outputs
from models.llama import Llama, LlamaConfig
from models.llama_xl import build_llama_xl
from models.rmt import RMT
from models.rmt_retrieval import RMTRetrieval
from tests.test_train import TINY, compose_train
from tests.tiny_models import VOCAB, TinyCausalLM, active_armt, brute_force_logprobs, tiny_llama_lm
from train import train

B, T, K, D = 3, 30, 6, 4
LENGTHS = [30, 22, 9]  # the last row is too short for any short context


@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    return TinyCausalLM(seed=2)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask."""
    input_ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    return input_ids.masked_fill(~mask, 0), mask


def scored_mask(mask: torch.Tensor) -> torch.Tensor:
    """Predicted real tokens of a right-padded batch: real and not the first token."""
    return mask & (torch.arange(mask.shape[1]) > 0)


def test_unit_weights_give_cross_entropy(batch):
    input_ids, mask = batch
    logits = torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(2))
    logprobs = token_logprobs(logits, input_ids)
    weights = longce_weights(logprobs, logprobs.clone(), scored_mask(mask), gamma=5.0)  # LSD = 0
    targets = input_ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    assert torch.equal(weights, torch.ones_like(weights))
    torch.testing.assert_close(longce_loss(logprobs, weights, scored_mask(mask)), expected)


def test_weights_are_clipped_likelihood_ratios_and_one_without_short_context():
    long = torch.tensor([-1.0, -0.5, -3.0, -2.0, -0.1])
    short = torch.tensor([-2.0, -4.0, -1.0, -9.0, float("nan")])
    has_short = torch.tensor([True, True, True, False, False])
    expected = torch.tensor([torch.e, 5.0, torch.exp(torch.tensor(-2.0)).item(), 1.0, 1.0])
    torch.testing.assert_close(longce_weights(long, short, has_short, gamma=5.0), expected)


def test_weights_carry_no_gradient_and_loss_gradient_is_weighted_ce_gradient(batch):
    input_ids, mask = batch
    logits = torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(3), requires_grad=True)
    logprobs = token_logprobs(logits, input_ids)
    short = logprobs.detach() + torch.randn(B, T, generator=torch.Generator().manual_seed(4))
    has_short = mask & (torch.arange(T) >= K)
    weights = longce_weights(logprobs, short, has_short, gamma=2.0)
    scored = scored_mask(mask)
    longce_loss(logprobs, weights, scored).backward()

    assert not weights.requires_grad
    assert (weights[has_short] != 1).any() and (weights == 2.0).any()
    # d(-w_j log p_j)/d logits_{j-1} = w_j (softmax - onehot), averaged over the scored tokens.
    ce_grad = logits.detach().softmax(-1) - F.one_hot(input_ids.roll(-1, dims=1), VOCAB)  # (B, T, V) at j-1
    weight_at_prev = (weights * scored).roll(-1, dims=1)[..., None]  # (B, T, 1): token j's weight at j-1
    torch.testing.assert_close(logits.grad, weight_at_prev * ce_grad / scored.sum())
    with pytest.raises(ValueError, match="no gradient"):
        longce_loss(logprobs, weights.requires_grad_(), scored)


def test_batch_loss_matches_brute_force(model, batch):
    input_ids, mask = batch
    gamma = 1.5
    expected_terms = []
    for row, length in enumerate(LENGTHS):
        long, short, has_short = brute_force_logprobs(model, input_ids[row, :length], K, D)
        weight = torch.where(has_short, (long - short).exp().clamp(max=gamma), 1.0)
        expected_terms.append(-(weight * long)[1:])
    expected_terms = torch.cat(expected_terms)

    loss = longce_loss_for_batch(model, input_ids, model(input_ids), mask, K, D, gamma, batch_size=3)

    torch.testing.assert_close(loss, expected_terms.mean())
    assert not torch.isclose(
        loss, F.cross_entropy(model(input_ids)[:, :-1][mask[:, 1:]], input_ids[:, 1:][mask[:, 1:]])
    )


def test_padding_tokens_and_logits_do_not_change_the_loss(model, batch):
    input_ids, mask = batch
    logits = model(input_ids)
    loss = longce_loss_for_batch(model, input_ids, logits, mask, K, D)
    other_ids = input_ids.masked_fill(~mask, 5)
    other_logits = torch.where(mask[..., None], logits, torch.randn_like(logits) * 100)
    torch.testing.assert_close(longce_loss_for_batch(model, other_ids, other_logits, mask, K, D), loss)


def test_short_context_starts_at_the_first_full_block_of_each_row(model, batch):
    input_ids, mask = batch
    short, has_short = sliding_window_short_logprobs(model, input_ids, mask, K, D)
    assert torch.equal(has_short, mask & (torch.arange(T) >= first_short_index(K, D)))
    assert not short[has_short].isnan().any() and short[~has_short].isnan().all()


# ---- LongCE as the injected loss, through CausalLM.short_context_logprobs ------------------------------------

LM_T, LM_K, LM_D = 24, 6, 4


@pytest.fixture(scope="module")
def lm():
    return tiny_llama_lm(window=LM_T, seed=3, init_std=0.3)


@pytest.fixture(scope="module")
def lm_batch() -> tuple[dict, list[torch.Tensor], list[int]]:
    """Rows as the datamodules make them: a shuffled chunk (no padding), an ordered-stream document end (right
    padding, the last input masked) and a left-padded row. Returns the batch, each row's text (real inputs, then
    the last target) and where the text starts in the row."""
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (LM_T + 1, 15, 17)]
    ids = torch.zeros(3, LM_T, dtype=torch.long)
    labels = torch.full((3, LM_T), -100)
    mask = torch.zeros(3, LM_T, dtype=torch.long)
    ids[0], labels[0], mask[0] = texts[0][:-1], texts[0][1:], 1
    p = len(texts[1])  # ordered stream: inputs 0..p-1 hold the piece, labels 0..p-2, input p-1 masked
    ids[1, :p], labels[1, : p - 1], mask[1, : p - 1] = texts[1], texts[1][1:], 1
    n = len(texts[2]) - 1  # left padding: n real inputs at the end, each labelled with its successor
    ids[2, -n:], labels[2, -n:], mask[2, -n:] = texts[2][:-1], texts[2][1:], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}, texts, [0, 0, LM_T - n]


def brute_force_rows(lm, texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(long, short, has_short) of every row's targets, concatenated in row-major order (text index 0 dropped)."""
    parts = [brute_force_logprobs(lm.backbone.logits, text, LM_K, LM_D) for text in texts]
    return tuple(torch.cat([part[i][1:] for part in parts]) for i in range(3))


def test_causal_lm_short_context_logprobs_match_one_forward_per_target(lm, lm_batch):
    batch, texts, _ = lm_batch
    out = lm(batch)
    long, short, has_short = brute_force_rows(lm, texts)
    torch.testing.assert_close(out.logits.log_softmax(-1).gather(-1, out.targets[:, None])[:, 0], long)
    got = lm.short_context_logprobs(batch, out, K=LM_K, d=LM_D)
    assert not got.requires_grad and torch.equal(got.isnan(), ~has_short)
    torch.testing.assert_close(got[has_short], short[has_short])


def test_longce_through_causal_lm_matches_the_brute_force_definition(lm, lm_batch):
    batch, texts, _ = lm_batch
    gamma = 1.5
    long, short, has_short = brute_force_rows(lm, texts)
    weights = torch.where(has_short, (long - short).exp().clamp(max=gamma), 1.0)
    assert (weights != 1).any() and (weights == gamma).any()
    loss = LongCE(gamma, LM_K, LM_D)(lm(batch), lm, batch)
    torch.testing.assert_close(loss, -(weights * long).mean())


def test_longce_reports_the_plain_cross_entropy_and_how_its_weights_fell(lm, lm_batch):
    batch, texts, _ = lm_batch
    long, short, has_short = brute_force_rows(lm, texts)
    weights = torch.where(has_short, (long - short).exp().clamp(max=1.5), 1.0)
    longce = LongCE(1.5, LM_K, LM_D)
    out = lm(batch)
    longce(out, lm, batch)
    assert (weights > 1).any() and (weights < 1).any()
    torch.testing.assert_close(longce.logged["ce"], CrossEntropy()(out, lm, batch))
    torch.testing.assert_close(longce.logged["longce_weight"], weights.mean())
    torch.testing.assert_close(longce.logged["longce_up"], (weights > 1).float().mean())
    torch.testing.assert_close(longce.logged["longce_down"], (weights < 1).float().mean())


def test_longce_without_short_contexts_is_cross_entropy(lm, lm_batch):
    batch, _, _ = lm_batch
    out = lm(batch)
    no_short = LongCE(gamma=5.0, K=LM_T, d=LM_T)  # no block starts at or after K within a row
    torch.testing.assert_close(no_short(out, lm, batch), CrossEntropy()(out, lm, batch))


def test_longce_gradient_treats_the_weights_as_constants(lm, lm_batch):
    batch, _, _ = lm_batch
    longce = LongCE(gamma=3.0, K=LM_K, d=LM_D)
    lm.zero_grad()
    longce(lm(batch), lm, batch).backward()
    grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    out = lm(batch)
    logprobs = -F.cross_entropy(out.logits, out.targets, reduction="none")
    short = lm.short_context_logprobs(batch, out, K=LM_K, d=LM_D)
    weights = torch.where(short.isnan(), 1.0, (logprobs.detach() - short).exp().clamp(max=3.0))
    (-(weights * logprobs).mean()).backward()
    for got, expected in zip(grads, (p.grad for p in lm.parameters()), strict=True):
        torch.testing.assert_close(got, expected)
    lm.zero_grad()


def test_longce_ignores_padding_ids_and_labels(lm, lm_batch):
    batch, _, starts = lm_batch
    loss = LongCE(5.0, LM_K, LM_D)(lm(batch), lm, batch)
    pad = batch["attention_mask"] == 0  # row 1's last input too: its token comes back as the last label
    other = {**batch, "input_ids": batch["input_ids"].masked_fill(pad, 7)}
    torch.testing.assert_close(LongCE(5.0, LM_K, LM_D)(lm(other), lm, other), loss)
    assert starts[2] > 0 and pad[2, : starts[2]].all()


def test_block_whose_window_is_the_full_context_is_skipped_with_the_weights_of_the_definition(lm, lm_batch):
    batch, texts, _ = lm_batch
    K = d = 4  # block k = 1 (text indices 4..7): its window starts at the row's first token
    parts = [brute_force_logprobs(lm.backbone.logits, text, K, d) for text in texts]
    long, short, has_short = (torch.cat([part[i][1:] for part in parts]) for i in range(3))
    index = torch.cat([torch.arange(1, len(text)) for text in texts])  # text index of each target
    got = lm.short_context_logprobs(batch, lm(batch), K=K, d=d)
    torch.testing.assert_close(long[(index >= K) & (index < 2 * K)], short[(index >= K) & (index < 2 * K)])
    assert torch.equal(got.isnan(), index < 2 * K) and torch.equal(has_short, index >= K)
    torch.testing.assert_close(got[index >= 2 * K], short[index >= 2 * K])
    weights = torch.where(has_short, (long - short).exp().clamp(max=1.5), 1.0)
    torch.testing.assert_close(LongCE(1.5, K, d)(lm(batch), lm, batch), -(weights * long).mean())


def test_head_logprobs_in_chunks_equal_one_log_softmax(monkeypatch):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, VOCAB, bias=False)
    hidden, targets = torch.randn(3, 7, 8, generator=g), torch.randint(0, VOCAB, (3, 7), generator=g)
    expected = head(hidden).log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    monkeypatch.setattr(outputs, "HEAD_CHUNK", 4 * VOCAB)  # 21 positions in chunks of 4
    torch.testing.assert_close(outputs.head_logprobs(head, hidden, targets), expected)


def test_short_context_defaults_to_a_quarter_of_the_training_length(lm, lm_batch):
    batch, _, _ = lm_batch
    out = lm(batch)
    K = LM_T // 4
    assert torch.equal(
        lm.short_context_logprobs(batch, out).isnan(), lm.short_context_logprobs(batch, out, K=K, d=K).isnan()
    )
    torch.testing.assert_close(LongCE()(out, lm, batch), LongCE(5.0, K, K)(out, lm, batch))


def test_non_next_token_labels_and_gamma_below_one_raise(lm, lm_batch):
    batch, _, _ = lm_batch
    shifted = {**batch, "labels": batch["labels"].roll(1, dims=1)}
    with pytest.raises(ValueError, match="next-token labels"):
        LongCE(5.0, LM_K, LM_D)(lm(shifted), lm, shifted)
    with pytest.raises(ValueError, match="must be >= 1"):
        LongCE(gamma=0.5)


def test_train_switches_between_ce_and_longce_by_config(tmp_path):
    losses = {}
    for loss in ("ce", "longce"):
        cfg = compose_train(
            [*TINY, f"loss={loss}", "loss.K=8", "loss.d=8"][: None if loss == "longce" else -2]
            + ["trainer.max_steps=3", "trainer.val_check_interval=3", f"run_dir={tmp_path / loss}"]
        )
        losses[loss] = train(cfg)["train/loss"]
    assert all(math.isfinite(v) for v in losses.values()) and losses["ce"] != losses["longce"]


# ---- recurrent models: the short context is the target's own segment -----------------------------------------
def recurrent_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=64, max_positions=64
    )
    if name == "llama_xl":
        return build_llama_xl(Llama(LlamaConfig(**cfg, key_norm=True, attn_scale=1.0)), segment_size=8)
    builder = {"rmt": RMT, "rmt_r": RMTRetrieval, "armt": active_armt}[name]
    return builder(Llama(LlamaConfig(**cfg)), num_memory=4, segment_size=8)


@pytest.mark.parametrize("name", ["rmt", "rmt_r", "armt", "llama_xl"])
def test_recurrent_short_context_is_each_segment_alone_and_keeps_the_stream(name):
    model = recurrent_model(name)
    gen = torch.Generator().manual_seed(3)
    stream = [
        {
            "input_ids": torch.randint(0, VOCAB, (2, 24), generator=gen),
            "labels": torch.randint(0, VOCAB, (2, 24), generator=gen),
            "reset": torch.tensor([i == 0, True]),
        }
        for i in range(2)
    ]
    alone = [
        model({k: v[:, a : a + 8] for k, v in stream[0].items() if k != "reset"}) for a in range(0, 24, 8)
    ]  # a batch without `reset` starts from fresh memory / an empty cache
    expected = torch.cat(
        [-F.cross_entropy(o.logits, o.targets, reduction="none").view(2, 8) for o in alone], 1
    )
    out = model(stream[0])
    short = model.short_context_logprobs(stream[0], out)  # (48,)
    torch.testing.assert_close(short, expected.flatten(), atol=1e-5, rtol=1e-5)
    long = -F.cross_entropy(out.logits, out.targets, reduction="none")
    assert not torch.allclose(short, long)  # memory / cache changes later segments' predictions

    continued = model(stream[1]).logits  # the stream after the short-context pass ...
    model(stream[0])
    torch.testing.assert_close(continued, model(stream[1]).logits)  # ... is the stream without it
    loss = LongCE(gamma=5.0)(out, model, stream[0])
    assert math.isfinite(loss.item())
