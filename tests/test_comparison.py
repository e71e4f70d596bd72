"""Comparing evaluated checkpoints: results read back from the evaluators' files, copy gain, correlations, table
and figure; and evaluate.py compare=[...] end to end on trained checkpoints."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_evaluate import Oracle, cache, compose_eval, tiny_corpus, trained  # noqa: F401  (fixtures)

from callbacks.comparison import (
    EvaluatedModel,
    babilong_rows,
    compare,
    correlations,
    markdown_table,
    plot_comparison,
)
from callbacks.forgetting_curve import ForgettingCurveResult
from callbacks.ppl_by_position import PplByPositionResult
from evaluate import babilong, evaluate
from models.config_errors import ConfigError
from tests.figures import assert_texts_inside


def model(label, copy, lm, ppl, longppl):
    fc = ForgettingCurveResult([16, 32, 64], copy, [0.0] * 3, lm, [0.0] * 3, n_samples=4, seed=0)
    by_pos = PplByPositionResult([1, 8, 64, 512], [10.0, 20.0, 30.0], [7, 56, 448], n_docs=1)
    return EvaluatedModel(label, 100, ppl, longppl, 12, 4000, fc, by_pos)


def forgetting_curve_gains(results):
    """The forgetting curve saved under a results folder, and its copy minus LM accuracy by length."""
    curve = json.loads((Path(results) / "forgetting_curve" / "forgetting_curve.json").read_text())
    return curve, dict(zip(curve["lengths"], np.subtract(curve["copy_acc"], curve["lm_acc"]), strict=True))


def train_in_subprocess(*overrides: str) -> None:
    """`python train.py <overrides>` from the repository root, as a user runs it; fails if the run fails."""
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "train.py", *overrides], cwd=root, check=True, capture_output=True)


def family():
    return [
        model("short", [0.3, 0.2, 0.2], [0.2, 0.2, 0.2], 50.0, 90.0),
        model("mid", [0.9, 0.5, 0.25], [0.25, 0.25, 0.25], 40.0, 60.0),
        model("long", [1.0, 0.995, 0.6], [0.3, 0.3, 0.3], 45.0, 30.0),
        model("best", [1.0, 1.0, 0.9], [0.3, 0.3, 0.3], 48.0, 20.0),
    ]


def test_copy_gain_rows_and_correlations_match_their_definitions():
    models = family()
    rows = [m.row(None) for m in models]
    gains = [np.mean(np.subtract(m.forgetting.copy_acc, m.forgetting.lm_acc)) for m in models]
    assert [r["copy_gain"] for r in rows] == pytest.approx(gains)
    assert [r["fine_len"] for r in rows] == [0, 0, 32, 32]
    assert [r["coarse_len"] for r in rows] == [16, 32, 64, 64]
    assert rows[0]["key_tokens_per_1k"] == pytest.approx(3.0)
    assert models[1].copy_gain(32) == pytest.approx(0.25)
    with pytest.raises(ConfigError, match="compare_score_length=48 is not a tested length of mid"):
        models[1].copy_gain(48)

    corr = correlations(rows)
    g, lp, pp = np.array(gains), np.array([90.0, 60.0, 30.0, 20.0]), np.array([50.0, 40.0, 45.0, 48.0])

    def pearson(x, y):
        dx, dy = x - x.mean(), y - y.mean()
        return (dx * dy).sum() / np.sqrt((dx**2).sum() * (dy**2).sum())

    assert corr["compare/pearson/longppl"] == pytest.approx(pearson(g, lp))
    assert corr["compare/pearson/ppl"] == pytest.approx(pearson(g, pp))
    assert corr["compare/spearman/longppl"] == pytest.approx(-1.0)  # LongPPL falls as the gain rises
    assert corr["compare/spearman/ppl"] == pytest.approx(
        pearson(np.array([0, 1, 2, 3.0]), np.array([3, 0, 1, 2.0]))
    )
    two = correlations(rows[:2])
    assert np.isnan(two["compare/pearson/ppl"])  # fewer than 3 models: no correlation


def test_compare_writes_table_json_and_a_readable_figure(tmp_path):
    models = family()
    corr = compare(models, tmp_path, score_length=64)
    saved = json.loads((tmp_path / "comparison.json").read_text())
    assert saved["score_length"] == 64 and [m["copy_gain"] for m in saved["models"]] == pytest.approx(
        [0.0, 0.0, 0.3, 0.6]
    )
    assert saved["compare/pearson/longppl"] == pytest.approx(corr["compare/pearson/longppl"])
    table = (tmp_path / "comparison.md").read_text().splitlines()
    assert table[0].startswith("| model | step | ppl | longppl |") and len(table) == 2 + len(models)
    assert table[-1].startswith("| best | 100 | 48.0 | 20.0 | 3.0 | 32 | 64 | +0.600 |")
    assert (tmp_path / "comparison.png").stat().st_size > 10_000
    assert_texts_inside(plot_comparison(models, [m.row(None) for m in models]))
    assert markdown_table([{"model": "x", "ppl": None}]).splitlines()[-1] == "| x | – |"


def test_nothing_to_compare_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no forgetting_curve, ppl_by_position or babilong results"):
        compare([EvaluatedModel("bare", 0, ppl=3.0)], tmp_path)


def test_babilong_results_of_several_models_make_one_tasks_by_lengths_table(tmp_path, cache):  # noqa: F811
    """Each model's babilong evaluator files, read back: rows by task (models in the given order within a task),
    lengths in order, the ablations' columns after them; the heat map of the carried cells; no comparison files
    when there is nothing else to compare."""
    from data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    folders = {}
    for label, wrong in (("rmt", ("qa2",)), ("rmt_r", ())):
        folders[label] = tmp_path / label / "babilong"
        for task in ("qa2", "qa1"):  # each model trained and evaluated per task, in two calls: cells merge
            babilong(
                Oracle(tokenizer.vocab_size, wrong=wrong),
                tokenizer,
                tiny_corpus(),
                folders[label],
                tasks=(task,),
                lengths=(200, 0),
                n=2,
                batch_size=2,
            )
    reset = {"n": 2, "memory": "reset", "accuracy": {"qa1": {"1k": 0.5}}}
    (folders["rmt_r"] / "babilong_reset_early_facts.json").write_text(json.dumps(reset))
    latest = {"n": 2, "memory": "latest", "accuracy": {"qa1": {"1k": 0.25}}}
    (folders["rmt_r"] / "babilong_latest_early_facts.json").write_text(json.dumps(latest))
    models = [EvaluatedModel.load(tmp_path / label, label, 7) for label in folders]
    assert models[0].babilong["babilong"] == {"qa2": {"200": 0.0, "0k": 0.0}, "qa1": {"200": 1.0, "0k": 1.0}}
    rows = babilong_rows(models)
    assert [(r["model"], r["task"]) for r in rows] == [
        ("rmt", "qa1"),
        ("rmt_r", "qa1"),
        ("rmt", "qa2"),
        ("rmt_r", "qa2"),
    ]
    assert list(rows[0]) == ["model", "task", "facts only", "200", "early reset 1k", "early latest 1k"]
    assert [r["early reset 1k"] for r in rows] == [None, 0.5, None, None]
    assert [r["early latest 1k"] for r in rows] == [None, 0.25, None, None]
    assert compare(models, tmp_path / "cmp") == {}  # BABILong only: no correlations, no comparison.* files
    table = (tmp_path / "cmp" / "babilong.md").read_text().splitlines()
    assert table[0] == "| model | task | facts only | 200 | early reset 1k | early latest 1k |"
    assert table[2:] == [
        "| rmt | qa1 | 1.00 | 1.00 | – | – |",
        "| rmt_r | qa1 | 1.00 | 1.00 | 0.50 | 0.25 |",
        "| rmt | qa2 | 0.00 | 0.00 | – | – |",
        "| rmt_r | qa2 | 1.00 | 1.00 | – | – |",
    ]
    assert (tmp_path / "cmp" / "babilong.png").stat().st_size > 5_000
    assert not list((tmp_path / "cmp").glob("comparison.*"))


def test_evaluate_compare_evaluates_each_checkpoint_then_compares(trained, tmp_path):  # noqa: F811
    run_dir, _ = trained
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) >= 2  # last.ckpt and step<N>.ckpt of the same run: named with their file
    overrides = [
        f"compare=[{','.join(map(str, ckpts[:2]))}]",
        "eval=[ppl,longppl,forgetting_curve]",
        "eval.ppl.max_len=64",
        "eval.longppl.evaluator=self",
        "eval.longppl.K=8",
        "eval.longppl.d=8",
        "eval.longppl.max_len=64",
        "eval.longppl.alpha=-100",  # every token with a short context is a key token
        "eval.longppl.beta=-100",
        "eval.forgetting_curve.max_len=16",
        "eval.forgetting_curve.n_lengths=2",
        "eval.forgetting_curve.n_samples=2",
        "eval.forgetting_curve.split=train",
        f"out_dir={tmp_path / 'cmp'}",
        "logger=csv",
    ]
    evaluate(compose_eval(overrides))
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [m["model"] for m in saved["models"]] == [f"{run_dir.name}@{c.stem}" for c in ckpts[:2]]
    for ckpt, row in zip(ckpts, saved["models"], strict=False):
        results = ckpt.parent / f"{ckpt.name}.eval"
        assert row["ppl"] == json.loads((results / "ppl" / "ppl.json").read_text())["ppl"]
        longppl = json.loads((results / "longppl" / "longppl.json").read_text())
        assert row["longppl"] == longppl["longppl"] and longppl["longppl/n_key"] > 0
        assert row["key_tokens_per_1k"] == pytest.approx(
            1000 * longppl["longppl/n_key"] / longppl["longppl/n_tokens"]
        )
        fc = json.loads((results / "forgetting_curve" / "forgetting_curve.json").read_text())
        assert row["copy_gain"] == pytest.approx(np.mean(np.subtract(fc["copy_acc"], fc["lm_acc"])))
    folders = [f"{c}.eval" for c in ckpts[:2]]  # read back as they are, named as their checkpoints
    evaluate(compose_eval([f"compare=[{','.join(folders)}]", f"out_dir={tmp_path / 'again'}"]))
    again = json.loads((tmp_path / "again" / "comparison.json").read_text())["models"]
    assert [m["model"] for m in again] == [m["model"] for m in saved["models"]]  # one row each
    assert [m["ppl"] for m in again] == [m["ppl"] for m in saved["models"]]
    assert [m["step"] for m in again] == [m["step"] for m in saved["models"]]  # each checkpoint's step, not 0
    with pytest.raises(ConfigError, match="drop ckpt_path"):
        evaluate(compose_eval([f"compare=[{ckpts[0]}]", f"ckpt_path={ckpts[0]}"]))


@pytest.mark.slow
def test_longppl_and_the_forgetting_curve_separate_context_windows_where_ppl_barely_does(
    tmp_path, monkeypatch
):
    """SmolLM2-135M through a 32-token and a 1024-token sliding window on a KJV test book (the window family of
    docs/forgetting_longppl.md, shortened): the full window copies and the short one does not; LongPPL grows far more
    than PPL. About 6 minutes on one core."""
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))
    for window in (32, 1024):
        overrides = [
            "backbone=smollm2_135m",
            "corpus=kjv",
            f"model.window={window}",
            "eval=[ppl,longppl,forgetting_curve]",
            "eval.ppl.max_docs=1",
            "eval.ppl.max_len=1024",
            "eval.longppl.K=64",
            "eval.longppl.d=64",
            "eval.longppl.max_docs=1",
            "eval.longppl.max_len=1024",
            "eval.forgetting_curve.max_len=128",
            "eval.forgetting_curve.n_lengths=2",
            "eval.forgetting_curve.n_samples=2",
            f"out_dir={tmp_path / f'w{window}'}",
            "logger=csv",
        ]
        evaluate(compose_eval(overrides))
    evaluate(
        compose_eval([f"compare=[{tmp_path / 'w32'},{tmp_path / 'w1024'}]", f"out_dir={tmp_path / 'cmp'}"])
    )
    short, full = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["models"]
    assert full["copy_gain"] > 0.4 and short["copy_gain"] < 0.05, (short, full)
    assert full["key_tokens_per_1k"] > 5  # the KJV gives key tokens (State of the Union text: 0-2 per 1,000)
    ppl_ratio, longppl_ratio = short["ppl"] / full["ppl"], short["longppl"] / full["longppl"]
    assert longppl_ratio > 5 and longppl_ratio > 3 * ppl_ratio, (ppl_ratio, longppl_ratio)


@pytest.mark.slow
def test_smollm2_as_llama_xl_copies_within_segment_and_cache_and_forgets_past_them(tmp_path, monkeypatch):
    """The Llama-XL finding of docs/forgetting_longppl.md with a model that copies, shortened: SmolLM2-135M run as
    Llama-XL (its keys as trained) with segments of 64 and the previous one cached copies a 48-token prefix and
    copies no better than it predicts text at 3x segment + cache and beyond. 12 minutes on one core beside another
    job (with the conversion of SmolLM2 into the fresh cache)."""
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))
    overrides = [
        "backbone=smollm2_135m",
        "model=llama_xl",
        "model.segment_size=64",
        "model.backbone.key_norm=false",
        "model.backbone.attn_scale=null",
        "eval=[forgetting_curve]",
        "eval.forgetting_curve.max_len=480",
        "eval.forgetting_curve.n_lengths=10",
        "eval.forgetting_curve.n_samples=4",
        f"out_dir={tmp_path}",
        "logger=csv",
    ]
    evaluate(compose_eval(overrides))
    curve, gain = forgetting_curve_gains(tmp_path)
    copy = dict(zip(curve["lengths"], curve["copy_acc"], strict=True))
    assert copy[48] > 0.9, copy
    assert all(abs(g) < 0.05 for length, g in gain.items() if length >= 384), gain


@pytest.mark.slow
def test_tiny_llama_xl_on_python_copies_and_predicts_through_its_cache_and_no_further(tmp_path):
    """Finding 3's tiny Llama-XL (experiment=forgetting_llama_xl_python, segments of 64 + the previous one cached),
    shortened to 1,500 steps, with and without its cache (window=): the cache lowers perplexity past one segment
    and lets it copy from 64-128 tokens back, and the same weights through a window of segment + cache (no
    recurrence) do as well. About 12 minutes on one core."""
    run = tmp_path / "run"
    train_in_subprocess(
        "experiment=forgetting_llama_xl_python",
        "trainer.max_steps=1500",
        "~callbacks.forgetting_curve",
        f"run_dir={run}",
    )
    ckpt = run / "checkpoints" / "last.ckpt"
    common = [f"ckpt_path={ckpt}", "eval=[ppl_by_position,forgetting_curve]", "threads=1", "logger=csv"]
    common += [
        f"eval.ppl_by_position.{k}={v}" for k, v in (("max_len", 4096), ("min_len", 4096), ("max_docs", 8))
    ]
    common += [
        f"eval.forgetting_curve.{k}={v}" for k, v in (("max_len", 256), ("n_lengths", 8), ("n_samples", 40))
    ]
    for window in (None, 64, 128):
        evaluate(compose_eval(common + ([f"window={window}"] if window else [])))
    folders = {
        w: run / "checkpoints" / f"last.ckpt{f'.window{w}' if w else ''}.eval" for w in (None, 64, 128)
    }

    def ppl_past(folder, start=279):
        result = PplByPositionResult.load_json(folder / "ppl_by_position" / "ppl_by_position.json")
        past = [i for i, a in enumerate(result.edges[:-1]) if a >= start]
        return np.exp(sum(result.nll_sum[i] for i in past) / sum(result.n_tokens[i] for i in past))

    xl, no_cache, span = (ppl_past(folders[w]) for w in (None, 64, 128))
    assert xl < 0.98 * no_cache, (xl, no_cache)  # the cache helps
    assert abs(span - xl) < 0.01 * xl, (span, xl)  # nothing beyond segment + cache
    _, gain = forgetting_curve_gains(folders[None])
    _, gain_no_cache = forgetting_curve_gains(folders[64])
    assert gain[64] > gain_no_cache[64] + 0.02, (gain, gain_no_cache)  # copies through the cache
    assert all(abs(g) < 0.02 for length, g in gain.items() if length >= 160), gain  # and not past it


@pytest.mark.slow
def test_smollm2_fine_tuned_with_a_segment_cache_reads_it_better_than_untrained(tmp_path):
    """Finding 3's fine-tuned Llama-XL, shortened to 40 steps of experiment=forgetting_smollm2_xl: past segment +
    cache (positions 512-2,047 of 3 test speeches) its perplexity falls below the untrained SmolLM2-XL's.
    About 10 minutes on one core."""
    run = tmp_path / "run"
    train_in_subprocess(
        "experiment=forgetting_smollm2_xl",
        "trainer.max_steps=40",
        "trainer.val_check_interval=40",
        "threads=1",
        f"run_dir={run}",
    )
    settings = (("max_len", 2048), ("max_docs", 3), ("kind", "linear"), ("n_bins", 4))
    by_position = ["eval=[ppl_by_position]", "threads=1", "logger=csv"]
    by_position += [f"eval.ppl_by_position.{k}={v}" for k, v in settings]
    untrained = [
        "backbone=smollm2_135m",
        "model=llama_xl",
        "model.segment_size=256",
        f"out_dir={tmp_path}/xl",
    ]
    untrained += ["model.backbone.key_norm=false", "model.backbone.attn_scale=null"]  # as the experiment's XL
    evaluate(compose_eval([*untrained, *by_position]))
    evaluate(compose_eval([f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", *by_position]))

    def ppl_past_cache(folder):
        result = PplByPositionResult.load_json(folder / "ppl_by_position" / "ppl_by_position.json")
        past = [i for i, start in enumerate(result.edges[:-1]) if start >= 512]
        return np.exp(sum(result.nll_sum[i] for i in past) / sum(result.n_tokens[i] for i in past))

    before = ppl_past_cache(tmp_path / "xl")
    after = ppl_past_cache(run / "checkpoints" / "last.ckpt.eval")
    assert after < 0.85 * before, (before, after)


@pytest.mark.slow
def test_longce_on_the_untrained_smollm2_xl_down_weights_most_tokens(tmp_path):
    """Finding 4's LongCE on SmolLM2 as Llama-XL, its first 4 steps: the untrained cache hurts more tokens than it
    helps (LSD < 0), so LongCE gives most tokens a weight below 1, the opposite of CE's push to repair the cache.
    Measured: 0.62-0.67 of the tokens down-weighted at steps 1-3. About 2 minutes on one core."""
    train_in_subprocess(
        "experiment=forgetting_smollm2_xl",
        "loss=longce",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.log_every_n_steps=1",
        "task.val_batches=1",
        "threads=1",
        f"run_dir={tmp_path}",
    )
    with open(next(tmp_path.glob("csv/*/metrics.csv"))) as f:
        rows = [row for row in csv.DictReader(f) if row["train/longce_down"]]
    # step 0 is every stream's first segment: no cache, weight 1
    down = {int(row["step"]): float(row["train/longce_down"]) for row in rows if int(row["step"]) >= 1}
    assert len(down) == 3 and all(share > 0.5 for share in down.values()), down


@pytest.mark.slow
def test_smollm2_fine_tuned_as_rmt_copies_within_a_segment_and_nothing_past_it(tmp_path):
    """Finding 3's RMT around a model that copies, shortened: after 30 steps of experiment=forgetting_smollm2_rmt
    with segments of 64 it copies a 32-token prefix within the segment, and copies no better than it predicts text
    once the prefix lies a segment or more back (no fine-grained memory through 16 memory tokens). About 8 minutes
    on one core."""
    run = tmp_path / "run"
    train_in_subprocess(
        "experiment=forgetting_smollm2_rmt",
        "model.segment_size=64",
        "trainer.max_steps=30",
        "trainer.val_check_interval=30",
        "threads=1",
        f"run_dir={run}",
    )
    settings = (("max_len", 256), ("n_lengths", 8), ("n_samples", 8))
    fc = [f"eval.forgetting_curve.{k}={v}" for k, v in settings]
    ckpt = run / "checkpoints" / "last.ckpt"
    evaluate(compose_eval([f"ckpt_path={ckpt}", "eval=[forgetting_curve]", *fc, "threads=1", "logger=csv"]))
    _, gain = forgetting_curve_gains(run / "checkpoints" / "last.ckpt.eval")
    assert gain[32] > 0.3, gain  # measured: 0.67 copy against 0.20 LM
    assert all(abs(g) < 0.05 for length, g in gain.items() if length >= 64), gain


@pytest.mark.slow
def test_a_tiny_llama_trained_on_the_bible_at_256_has_coarse_memory_and_amnesia_past_it(tmp_path):
    """Finding 2 of docs/forgetting_longppl.md, shortened to 3,000 steps (12.3M tokens): a coarse-grained memory of
    at least a quarter of the training length and amnesia at 2x and 4x it (no fine-grained memory yet). About 20
    minutes on one core."""
    train_in_subprocess(
        "experiment=forgetting_llama",
        "corpus=kjv",
        "trainer.max_steps=3000",
        "callbacks.forgetting_curve.split=test",  # the Bible's validation books are too short for 768-token targets
        f"run_dir={tmp_path / 'run'}",
    )
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    fc = [
        f"eval.forgetting_curve.{k}={v}" for k, v in (("max_len", 1024), ("n_lengths", 16), ("n_samples", 40))
    ]
    evaluate(compose_eval([f"ckpt_path={ckpt}", "eval=[forgetting_curve]", *fc, "logger=csv"]))
    curve, gain = forgetting_curve_gains(tmp_path / "run" / "checkpoints" / "last.ckpt.eval")
    assert curve["fine_length"] == 0 and curve["coarse_length"] >= 64, curve
    assert all(abs(g) < 0.01 for length, g in gain.items() if length >= 512), gain


@pytest.mark.slow
def test_a_tiny_llama_taught_to_copy_then_trained_on_text_copies_to_half_its_length_and_forgets_past_it(
    tmp_path,
):
    """Finding 2's copying Llama, shortened: experiment=copy_warmup (1,500 steps of random tokens repeated), then
    1,000 steps of text at length 128 (a quarter of the rows repeated): it copies text it has never seen up to half
    the training length, and copy equals LM accuracy from the training length on. About 12 minutes on one core."""
    train_in_subprocess(
        "experiment=copy_warmup", "~callbacks.forgetting_curve", f"run_dir={tmp_path / 'warm'}"
    )
    train_in_subprocess(
        "experiment=forgetting_llama_copy",
        f"init_from={tmp_path / 'warm' / 'checkpoints' / 'last.ckpt'}",
        "task.seq_len=128",
        "task.batch_size=32",
        "trainer.max_steps=1000",
        "~callbacks.forgetting_curve",
        f"run_dir={tmp_path / 'run'}",
    )
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    fc = [
        f"eval.forgetting_curve.{k}={v}" for k, v in (("max_len", 512), ("n_lengths", 16), ("n_samples", 20))
    ]
    evaluate(compose_eval([f"ckpt_path={ckpt}", "eval=[forgetting_curve]", *fc, "logger=csv"]))
    curve, gain = forgetting_curve_gains(f"{ckpt}.eval")
    copy = dict(zip(curve["lengths"], curve["copy_acc"], strict=True))
    assert copy[32] > 0.9 and gain[32] > 0.5 and gain[64] > 0.3, curve  # copies to half the training length
    assert curve["coarse_length"] >= 32, curve
    # amnesia from the training length
    assert all(abs(g) < 0.02 for length, g in gain.items() if length >= 128), gain
