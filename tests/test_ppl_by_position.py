"""Perplexity by position: against a brute-force per-token definition, for full, sliding-window and XL models."""

import math
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from callbacks.ppl_by_position import (
    PplByPosition,
    PplByPositionResult,
    plot_ppl_by_position,
    position_bins,
    ppl_by_position,
)
from models.llama import Llama, LlamaConfig
from models.llama_xl import LlamaXL
from models.lm import CausalLM
from tests.figures import assert_texts_inside

V = 61


def make_model(kind: str):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        ffn_size=64,
        max_positions=64,
        key_norm=kind == "xl",
        attn_scale=1.0 if kind == "xl" else None,
        init_std=0.1,
    )
    if kind == "xl":
        return LlamaXL(Llama(cfg), segment_size=8, cache_segments=1)
    return CausalLM(Llama(cfg), window=64 if kind == "full" else 16, stride=8)


def brute_force(model, docs, edges) -> tuple[list[float], list[int]]:
    """Per-bin perplexity and counts from each document's concatenated logits, one token at a time."""
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for doc in docs:
        ids = torch.as_tensor(doc[: edges[-1]], dtype=torch.long)
        logp = torch.cat(list(model.iter_logits(ids[None])), dim=1)[0].log_softmax(-1)
        for j in range(1, len(ids)):
            for i in range(len(edges) - 1):
                if edges[i] <= j < edges[i + 1]:
                    sums[i] -= float(logp[j - 1, ids[j]])
                    counts[i] += 1
    return [math.exp(s / n) if n else math.nan for s, n in zip(sums, counts, strict=True)], counts


@pytest.mark.parametrize("kind", ["full", "sliding", "xl"])
def test_matches_brute_force(kind):
    model = make_model(kind).eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, V, n).astype(np.uint32) for n in (40, 25, 50, 3, 50, 2)]
    edges = [2, 5, 11, 20, 33, 45]
    got = ppl_by_position(model, docs, edges, batch_size=2)
    want_ppl, want_counts = brute_force(model, docs, edges)
    assert got.n_tokens == want_counts and got.n_docs == 5  # the 2-token document has no position >= 2
    torch.testing.assert_close(torch.tensor(got.ppl), torch.tensor(want_ppl), rtol=1e-5, atol=1e-5)


def test_batching_does_not_change_the_result():
    model = make_model("xl")
    docs = [torch.randint(0, V, (n,)) for n in (30, 30, 30, 12)]
    edges = position_bins(30, 4, "linear")
    one, three = ppl_by_position(model, docs, edges), ppl_by_position(model, docs, edges, batch_size=3)
    torch.testing.assert_close(torch.tensor(three.nll_sum), torch.tensor(one.nll_sum), rtol=1e-5, atol=1e-5)
    assert three.n_tokens == one.n_tokens and model.training  # the model's mode is restored


def test_min_len_keeps_only_long_documents_so_every_bin_averages_the_same_ones(tmp_path, monkeypatch):
    import callbacks.ppl_by_position as module

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, V, n).astype(np.int64) for n in (12, 40, 33, 50)]
    monkeypatch.setattr(module, "held_out_docs", lambda corpus, tokenizer, split: docs)
    model = make_model("sliding")
    module.evaluate_ppl_by_position(
        model, None, None, tmp_path, max_len=32, n_bins=4, kind="linear", min_len=33
    )
    got = PplByPositionResult.load_json(tmp_path / "ppl_by_position.json")
    want = ppl_by_position(model, docs[1:], position_bins(32, 4, "linear"))
    assert got.n_docs == 3 and got.n_tokens == [3 * (b - a) for a, b in pairwise(got.edges)]
    torch.testing.assert_close(torch.tensor(got.nll_sum), torch.tensor(want.nll_sum))
    with pytest.raises(ValueError, match="No test document has min_len=51 tokens"):
        module.evaluate_ppl_by_position(model, None, None, tmp_path, max_len=32, min_len=51)


def test_position_bins():
    lin, log = position_bins(100, 4, "linear"), position_bins(65536, 16, "log")
    assert lin == [1, 26, 50, 75, 100]
    assert log[0] == 1 and log[-1] == 65536 and len(log) == 17
    ratios = np.diff(np.log(log[4:]))
    assert np.allclose(ratios, ratios[0], rtol=0.05)  # geometric once rounding stops mattering
    with pytest.raises(ValueError, match="bin kind"):
        position_bins(100, kind="cubic")
    with pytest.raises(ValueError, match="min_pos < max_len"):
        position_bins(1)


def test_result_files_round_trip(tmp_path):
    result = PplByPositionResult(edges=[1, 4, 16, 64], nll_sum=[6.0, 0.0, 9.0], n_tokens=[3, 0, 6], n_docs=2)
    assert result.ppl[0] == pytest.approx(math.exp(2.0)) and math.isnan(result.ppl[1])
    assert result.overall_ppl == pytest.approx(math.exp(15 / 9))
    result.save_json(tmp_path / "r.json")
    again = PplByPositionResult.load_json(tmp_path / "r.json")
    assert again.edges == result.edges and again.n_tokens == result.n_tokens and math.isnan(again.ppl[1])
    result.to_csv(tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().splitlines()[1] == f"1,4,{math.exp(2.0)},3"
    assert_texts_inside(plot_ppl_by_position(result, tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 0


def test_bad_iter_logits_is_explained():
    class Short(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def iter_logits(self, ids):
            yield torch.zeros(ids.shape[0], ids.shape[1] - 1, V)

    with pytest.raises(ValueError, match="covered 9 of 10"):
        ppl_by_position(Short(), [torch.zeros(10, dtype=torch.long)], [1, 10])
    with pytest.raises(ValueError, match="1-D"):
        ppl_by_position(Short(), [torch.zeros(2, 10, dtype=torch.long)], [1, 10])


class RecordingLogger:
    """Stands in for WandbLogger: scalars, tables and images by key."""

    def __init__(self):
        self.metrics, self.tables, self.images = [], {}, {}

    def log_metrics(self, metrics, step):
        self.metrics.append((step, metrics))

    def log_table(self, key, columns, data, step):
        self.tables[key] = (columns, data)

    def log_image(self, key, images, step):
        self.images[key] = images


def test_callback_runs_every_n_validations_and_logs(tmp_path):
    model = make_model("sliding")
    loaded = []

    def docs_fn():
        loaded.append(1)
        return [np.arange(40) % V, np.arange(33) % V]

    callback = PplByPosition(docs_fn=docs_fn, max_len=32, n_bins=4, every_n_val=2)
    logger = RecordingLogger()
    trainer = SimpleNamespace(
        sanity_checking=True,
        is_global_zero=True,
        global_step=0,
        default_root_dir=str(tmp_path),
        loggers=[logger],
    )
    module = SimpleNamespace(model=model)
    callback.on_validation_epoch_end(trainer, module)  # sanity check: skipped
    for step in (10, 20, 30, 40):
        trainer.sanity_checking, trainer.global_step = False, step
        callback.on_validation_epoch_end(trainer, module)
    assert [s for s, _ in logger.metrics] == [20, 40] and loaded == [1]
    _, scalars = logger.metrics[-1]
    want = ppl_by_position(model, docs_fn(), position_bins(32, 4))
    assert scalars["val/ppl_by_position/ppl"] == pytest.approx(want.overall_ppl)
    assert scalars["val/ppl_by_position/last_bin"] == pytest.approx(want.ppl[-1])
    columns, rows = logger.tables["val/ppl_by_position"]
    assert columns == ["start", "end", "ppl", "n_tokens"] and len(rows) == len(want.ppl)
    assert (
        PplByPositionResult.load_json(tmp_path / "ppl_by_position" / "step40.json").n_tokens == want.n_tokens
    )
    assert logger.images["val/ppl_by_position/plot"] == [str(tmp_path / "ppl_by_position" / "step40.png")]
