"""Forgetting curve: sampling, input layout, scored positions, memory lengths, batching, I/O and plotting."""

import csv

import numpy as np
import pytest
import torch

from callbacks.forgetting_curve import (
    ForgettingCurveResult,
    forgetting_curve,
    length_grid,
    plot_forgetting_curve,
)
from tests.figures import assert_texts_inside

BOS, EOS, WRONG = 1, 2, 0  # stream tokens are >= 3, so WRONG never equals a target


def permutation_stream(n: int = 1000, seed: int = 0) -> torch.Tensor:
    """No token repeats, so 'the earlier occurrence' of a token is unique."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 3


def run(predict, tokens, lengths, n_samples=4, **kwargs) -> ForgettingCurveResult:
    return forgetting_curve(
        predict, tokens, lengths, n_samples, bos_id=BOS, eos_id=EOS, progress=False, **kwargs
    )


def window_oracle(window: int):
    """Predicts the token that followed the most recent earlier occurrence of the current token when that
    occurrence is at most `window` positions back (a memory of `window` tokens); WRONG otherwise."""

    def predict(input_ids):  # (B, T) -> (B, T)
        t = torch.arange(input_ids.shape[1])
        back = t[:, None] - t[None, :]  # (T, T'): how far back t' lies
        seen = (input_ids[:, :, None] == input_ids[:, None, :]) & (back >= 1) & (back <= window)  # (B, T, T')
        latest = torch.where(seen, t, -1).amax(-1)  # (B, T)
        return torch.where(seen.any(-1), input_ids.gather(1, latest + 1), WRONG)

    return predict


class Recorder:
    """Wraps a predictor and keeps every batch it is called with."""

    def __init__(self, predict=None):
        self.predict = predict or (lambda x: torch.full_like(x, WRONG))
        self.batches = []

    def __call__(self, input_ids):
        self.batches.append(input_ids.clone())
        return self.predict(input_ids)


def scored_positions(length: int) -> torch.Tensor:
    """Second half of the second S in [bos] S [bos] S [eos] (offsets l//2 .. l-1, as in the reference code)."""
    second_copy = torch.arange(length + 2, 2 * length + 2)
    return second_copy[length // 2 :]


def predictor_right_at(positions_of):
    """Predicts the true next token exactly at the target positions `positions_of(length)`, WRONG elsewhere."""

    def predict(input_ids):
        length = (input_ids.shape[1] - 3) // 2
        out = torch.full_like(input_ids, WRONG)
        p = positions_of(length)
        out[:, p - 1] = input_ids[:, p]
        return out

    return predict


@pytest.mark.parametrize("window", [40, 41])
def test_window_oracle_fine_length_is_largest_length_within_window(window):
    lengths = length_grid(64, n=8)  # 8, 16, ..., 64
    result = run(window_oracle(window), permutation_stream(), lengths)
    remembered = [n for n in lengths if n + 1 <= window]  # the copy's token lies l + 1 positions back
    assert result.copy_acc == [1.0 if n in remembered else 0.0 for n in lengths]
    assert result.lm_acc == [0.0] * len(lengths)
    assert result.fine_length == result.coarse_length == max(remembered)
    assert [r["region"] for r in result.rows()] == ["fine" if n in remembered else "amnesia" for n in lengths]


def test_prefix_blind_bigram_predictor_gives_equal_curves_and_no_coarse_memory():
    gen = torch.Generator().manual_seed(0)
    vocab = 53
    table = torch.randint(3, vocab, (vocab,), generator=gen)
    stream = [3]
    for _ in range(3000):  # a Markov chain that follows the table 70% of the time
        follow = torch.rand((), generator=gen) < 0.7
        stream.append(int(table[stream[-1]]) if follow else int(torch.randint(3, vocab, (), generator=gen)))
    tokens = np.array(stream, dtype=np.uint32)  # the dtype of data.corpus token caches
    result = run(lambda x: table[x], tokens, length_grid(256, n=4), n_samples=6)
    assert result.copy_acc == result.lm_acc and result.copy_std == result.lm_std
    assert all(0.5 < a < 0.9 for a in result.copy_acc)
    assert result.coarse_length == 0 and result.fine_length == 0


@pytest.mark.parametrize("lengths", [[5, 8, 13], [1, 2, 3]])
def test_accuracy_counts_exactly_the_second_half_of_the_second_copy(lengths):
    tokens = permutation_stream(200)
    everywhere = predictor_right_at(lambda n: torch.arange(1, 2 * n + 3))
    only_half = predictor_right_at(scored_positions)
    outside_half = predictor_right_at(
        lambda n: torch.tensor(
            [p for p in range(1, 2 * n + 3) if p not in scored_positions(n)], dtype=torch.long
        )
    )
    for predict, expected in ((everywhere, 1.0), (only_half, 1.0), (outside_half, 0.0)):
        result = run(predict, tokens, lengths)
        assert result.copy_acc == result.lm_acc == [expected] * len(lengths)
        assert result.copy_std == [0.0] * len(lengths)


@pytest.mark.parametrize("miss", ["first", "last"])
def test_one_miss_in_the_scored_half_costs_exactly_one_over_its_size(miss):
    lengths = [5, 8, 13]

    def all_but_one(n):
        half = scored_positions(n)
        return half[1:] if miss == "first" else half[:-1]

    result = run(predictor_right_at(all_but_one), permutation_stream(200), lengths)
    expected = [1 - 1 / len(scored_positions(n)) for n in lengths]
    torch.testing.assert_close(result.copy_acc, expected)
    torch.testing.assert_close(result.lm_acc, expected)


def test_inputs_follow_the_copy_and_lm_layouts_with_non_overlapping_irrelevant_text():
    tokens = torch.arange(100, 400)  # token value - 100 = stream position
    rec = Recorder()
    run(rec, tokens, [7, 30], n_samples=5)
    for batch, n in zip(rec.batches, [7, 30], strict=True):
        copy, lm = batch[:5], batch[5:]
        for rows in (copy, lm):
            assert (rows[:, 0] == BOS).all() and (rows[:, n + 1] == BOS).all() and (rows[:, -1] == EOS).all()
        target = copy[:, 1 : n + 1]
        assert torch.equal(copy[:, n + 2 : 2 * n + 2], target) and torch.equal(
            lm[:, n + 2 : 2 * n + 2], target
        )
        irrelevant = lm[:, 1 : n + 1]
        for s, i in zip(target - 100, irrelevant - 100, strict=True):
            assert torch.equal(s, torch.arange(s[0], s[0] + n)) and torch.equal(
                i, torch.arange(i[0], i[0] + n)
            )
            assert not set(s.tolist()) & set(i.tolist())


def brute_force_valid_pairs(n_tokens: int, length: int, offsets) -> set[tuple[int, int]]:
    """All (target start, irrelevant start) pairs whose windows share no document."""
    doc_of = np.searchsorted(offsets, np.arange(n_tokens), side="right") - 1
    docs = [set(doc_of[s : s + length]) for s in range(n_tokens - length + 1)]
    return {(s, i) for s in range(len(docs)) for i in range(len(docs)) if not docs[s] & docs[i]}


@pytest.mark.parametrize(
    ("n_tokens", "length", "offsets"),
    [(40, 6, [0, 5, 13, 14, 14, 27, 33, 40]), (16, 6, [0, 2, 9, 16]), (14, 7, None)],
)
def test_sampling_covers_exactly_the_valid_target_irrelevant_pairs(n_tokens, length, offsets):
    rec = Recorder()
    run(rec, torch.arange(3, n_tokens + 3), [length], n_samples=1500, doc_offsets=offsets)
    batch = rec.batches[0]
    starts = batch[:, 1] - 3  # stream position of each row's first S / I token
    pairs = set(zip(starts[:1500].tolist(), starts[1500:].tolist(), strict=True))
    bounds = (
        np.arange(n_tokens + 1) if offsets is None else np.asarray(offsets)
    )  # None: one document per token
    valid = brute_force_valid_pairs(n_tokens, length, bounds)
    assert pairs <= valid
    assert {s for s, _ in pairs} == {s for s, _ in valid}  # every valid target start gets drawn


def test_stream_too_short_or_single_document_raises():
    tokens = permutation_stream(100)
    run(Recorder(), tokens, [50])  # 2l tokens are just enough
    with pytest.raises(ValueError, match="Length 51 needs"):
        run(Recorder(), tokens, [10, 51])
    with pytest.raises(ValueError, match="different documents"):
        run(Recorder(), tokens, [10], doc_offsets=[0, 100])
    with pytest.raises(
        ValueError, match="different documents"
    ):  # 2l tokens, but no 6-token window avoids S's docs
        run(Recorder(), torch.arange(3, 17), [6], doc_offsets=[0, 2, 9, 14])
    with pytest.raises(ValueError, match="doc_offsets must"):
        run(Recorder(), tokens, [10], doc_offsets=[0, 60, 50, 100])


def test_bad_predict_output_and_bad_lengths_raise():
    tokens = permutation_stream(100)
    with pytest.raises(ValueError, match=r"argmax\(-1\)"):
        run(lambda x: torch.zeros(*x.shape, 7), tokens, [8])
    with pytest.raises(ValueError, match="strictly increasing"):
        run(Recorder(), tokens, [16, 8])


def test_one_predict_call_per_length_with_all_copy_and_lm_inputs_and_max_batch_splits():
    tokens, lengths = permutation_stream(500), [4, 9, 20]
    rec = Recorder(window_oracle(15))
    result = run(rec, tokens, lengths, n_samples=4)
    assert [tuple(b.shape) for b in rec.batches] == [(8, 2 * n + 3) for n in lengths]
    split = Recorder(window_oracle(15))
    assert run(split, tokens, lengths, n_samples=4, max_batch=3) == result
    assert [len(b) for b in split.batches] == [3, 3, 2] * len(lengths)
    assert torch.equal(torch.cat(split.batches[:3]), rec.batches[0])


def test_same_seed_same_samples_other_seed_other_samples():
    tokens, lengths = permutation_stream(2000), [16, 64]
    a, b, c = Recorder(), Recorder(), Recorder()
    run(a, tokens, lengths, seed=3)
    run(b, tokens, lengths, seed=3)
    run(c, tokens, lengths, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.batches, b.batches, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a.batches, c.batches, strict=True))
    d = Recorder()
    run(d, tokens, [64], seed=3)  # a length's samples do not depend on the rest of the grid
    assert torch.equal(d.batches[0], a.batches[1])


def test_memory_lengths_follow_the_paper_thresholds():
    result = ForgettingCurveResult(
        lengths=[10, 20, 30, 40, 50, 60],
        copy_acc=[0.98, 0.99, 0.95, 0.5, 0.31, 0.2],  # short lengths below 99% do not end fine memory
        copy_std=[0.0] * 6,
        lm_acc=[0.3, 0.3, 0.3, 0.3, 0.3, 0.25],  # a gap of exactly 1 point (0.31 vs 0.3) is not "more than"
        lm_std=[0.0] * 6,
        n_samples=10,
        seed=0,
    )
    assert (result.fine_length, result.coarse_length) == (20, 40)
    assert [r["region"] for r in result.rows()] == ["fine", "fine", "coarse", "coarse", "amnesia", "amnesia"]
    with pytest.raises(ValueError, match="one entry per length"):
        ForgettingCurveResult([1, 2], [1.0], [0.0], [1.0], [0.0], n_samples=1, seed=0)


def test_json_round_trip_csv_and_plot(tmp_path):
    result = run(window_oracle(30), permutation_stream(), length_grid(64, n=8), n_samples=3)
    result.save_json(tmp_path / "fc.json")
    loaded = ForgettingCurveResult.load_json(tmp_path / "fc.json")
    assert loaded == result and loaded.fine_length == 24
    result.to_csv(tmp_path / "fc.csv")
    with open(tmp_path / "fc.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["length"]) for r in rows] == result.lengths
    assert [float(r["copy_acc"]) for r in rows] == result.copy_acc
    assert [r["region"] for r in rows] == [r["region"] for r in result.rows()]
    fig = plot_forgetting_curve(result, tmp_path / "fc.png", title="oracle")
    png = (tmp_path / "fc.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert {"copy accuracy", "LM accuracy", "amnesia"} <= set(labels)
    assert any(label.startswith("fine-grained memory") for label in labels)
    assert_texts_inside(fig)


def test_length_grid_linear_matches_paper_and_geometric_is_log_spaced():
    assert length_grid(32768) == [1024 * k for k in range(1, 33)]
    geo = length_grid(4096, n=7, kind="geometric", min_len=64)
    assert geo == [64, 128, 256, 512, 1024, 2048, 4096]
    assert length_grid(100, n=1) == [100]
    with pytest.raises(ValueError, match="linear"):
        length_grid(100, kind="log")
    with pytest.raises(ValueError, match="min_len"):
        length_grid(100, min_len=200)
