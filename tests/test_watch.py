"""The checkpoint watcher (`evaluate.py watch=RUN_DIR`) and the in-process `callbacks=eval_on_save`: every checkpoint
evaluated once, never a half-written or corrupt one, done work skipped after a restart."""

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from test_evaluate import compose_eval
from test_faults import ROOT, compose_train, tiny_overrides

from callbacks.checkpoint import AtomicCheckpointIO, CorruptCheckpointError, load_checkpoint
from callbacks.watch import Watcher, results_dir, state_digest, watch
from evaluate import CheckpointEvaluator, evaluate
from models.builders import build_run
from train import train

FAST_PPL = ["logger=csv", "eval.ppl.max_len=32", "eval.ppl.max_docs=1"]


class Counting:
    """An evaluate_fn that counts the checkpoints (by global step) it is given, then delegates (or returns {})."""

    def __init__(self, inner=None):
        self.inner, self.steps = inner, Counter()

    def __call__(self, path, checkpoint):
        self.steps[checkpoint["global_step"]] += 1
        return self.inner(path, checkpoint) if self.inner else {"step": float(checkpoint["global_step"])}


def test_watcher_evaluates_a_live_run_once_per_checkpoint_and_skips_a_truncated_file(tmp_path, caplog):
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    bad = ckpt_dir / "truncated.ckpt"  # dropped in once the run has started (a new run refuses a used folder)
    overrides = tiny_overrides(run_dir, 100, 10, "task.seq_len=64", "task.batch_size=4")
    env = dict(os.environ, WANDB_MODE="offline")
    evaluator = CheckpointEvaluator(compose_eval(FAST_PPL), run_dir)
    counting = Counting(evaluator)
    watcher = Watcher(ckpt_dir, counting, settle_s=0.0, tag=["ppl"])
    caplog.set_level(logging.INFO, logger="callbacks.watch")
    live = []
    with open(tmp_path / "train.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *overrides], cwd=ROOT, env=env, stdout=out, stderr=out
        )
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            live += watcher.scan()
            if live and not bad.exists():
                bad.write_bytes(b"PK\x03\x04 not a whole checkpoint")
            time.sleep(0.1)
        proc.wait(timeout=30)
    assert proc.returncode == 0, (tmp_path / "train.out").read_text()[-3000:]
    watcher.scan()
    evaluator.close()

    assert live, "nothing was evaluated while the run was training"
    assert set(counting.steps.values()) == {1}  # each global step once
    assert 100 in counting.steps and all(step % 10 == 0 for step in counting.steps)
    corrupt = [r for r in caplog.records if "corrupt or truncated" in r.getMessage()]
    assert len(corrupt) == 1 and str(bad) in corrupt[0].getMessage()  # logged once, then left alone
    assert not results_dir(bad).exists()
    for ckpt in set(ckpt_dir.glob("*.ckpt")) - {bad}:
        marker = json.loads((results_dir(ckpt) / "done.json").read_text())
        assert marker["identity"]["size"] == ckpt.stat().st_size
    results = [json.loads(p.read_text()) for p in ckpt_dir.glob("*.ckpt.eval/metrics.json")]
    final = [r for r in results if r["global_step"] == 100]
    assert len(final) == 1 and final[0]["metrics"]["eval/ppl"] > 1


@pytest.fixture
def finished_run(tmp_path):
    train(compose_train(tiny_overrides(tmp_path / "run", 4, 2)))
    return tmp_path / "run"


def replace_atomically(path, checkpoint):
    tmp = path.with_name(f".{path.name}.tmp1")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def test_restarted_watcher_skips_done_work_and_sees_a_replaced_last_ckpt(finished_run, caplog):
    ckpt_dir = finished_run / "checkpoints"
    # A writer's temporary file is never read.
    (ckpt_dir / ".last.ckpt.tmp999").write_bytes(b"half a checkpoint")
    first = Counting()
    assert {p.name for p in watch(ckpt_dir, first, once=True, settle_s=0, tag=["a"])} == {"step000004.ckpt"}
    assert first.steps == {4: 1}  # last.ckpt holds the same step: marked same_as, not evaluated again
    marker = json.loads((results_dir(ckpt_dir / "last.ckpt") / "done.json").read_text())
    assert marker["same_as"] == "step000004.ckpt"

    again = Counting()
    assert watch(ckpt_dir, again, once=True, settle_s=0, tag=["a"]) == [] and not again.steps

    later = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    later["global_step"] = 8
    replace_atomically(ckpt_dir / "last.ckpt", later)  # training went on: same name, new file
    assert watch(ckpt_dir, Counting(), once=True, settle_s=60, tag=["a"]) == []  # not settled yet
    assert [p.name for p in watch(ckpt_dir, again, once=True, settle_s=0, tag=["a"])] == ["last.ckpt"]
    assert again.steps == {8: 1}

    def broken(path, checkpoint):
        raise RuntimeError("evaluator bug")

    caplog.set_level(logging.ERROR, logger="callbacks.watch")
    # Another evaluator set redoes the work; a failing evaluator is logged and the watcher goes on.
    assert watch(ckpt_dir, broken, once=True, settle_s=0, tag=["b"]) == []
    failures = [r for r in caplog.records if "failed; the watcher goes on" in r.getMessage()]
    assert len(failures) == 2 and all("evaluator bug" in str(r.exc_info[1]) for r in failures)
    other = Counting()
    assert len(watch(ckpt_dir, other, once=True, settle_s=0, tag=["b"])) == 2 and other.steps == {4: 1, 8: 1}


def test_windowed_and_plain_watchers_keep_their_own_markers(finished_run):
    """watch=RUN window=W marks its work in <ckpt>.window<W>.eval/, so a plain watcher still evaluates every
    checkpoint, and each skips its own done work when restarted."""
    ckpt_dir = finished_run / "checkpoints"
    windowed, plain = Counting(), Counting()
    assert len(watch(ckpt_dir, windowed, once=True, settle_s=0, tag=["a"], window=64)) == 1
    assert (results_dir(ckpt_dir / "step000004.ckpt", 64) / "done.json").is_file()
    assert not results_dir(ckpt_dir / "step000004.ckpt").exists()
    assert len(watch(ckpt_dir, plain, once=True, settle_s=0, tag=["a"])) == 1
    assert windowed.steps == plain.steps == {4: 1}
    assert watch(ckpt_dir, windowed, once=True, settle_s=0, tag=["a"], window=64) == []
    assert watch(ckpt_dir, plain, once=True, settle_s=0, tag=["a"]) == []
    assert windowed.steps == plain.steps == {4: 1}


def test_watch_stops_after_timeout_and_refuses_a_missing_run(tmp_path):
    start = time.monotonic()
    assert watch(tmp_path, Counting(), poll_s=0.05, timeout_s=0.3) == []
    assert 0.3 <= time.monotonic() - start < 5
    with pytest.raises(FileNotFoundError, match="no such run folder"):
        evaluate(compose_eval([f"watch={tmp_path / 'nope'}", "watcher.once=true"]))


def test_eval_on_save_evaluates_each_saved_step_in_process(tmp_path):
    cfg = compose_train(
        tiny_overrides(tmp_path, 6, 3, "callbacks=eval_on_save", "eval.ppl.max_len=32", "eval.ppl.max_docs=1")
    )
    default = {"model_checkpoint", "memory_maps", "progress_log", "wandb_dashboard"}
    assert set(cfg.callbacks) == default | {"eval_on_save"}
    run = build_run(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)

    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        logged = Counter(int(row["step"]) for row in csv.DictReader(f) if row.get("eval/ppl"))
    assert logged == {3: 1, 6: 1}
    last = tmp_path / "checkpoints" / "last.ckpt"
    results = [json.loads(p.read_text()) for p in last.parent.glob("*.ckpt.eval/metrics.json")]
    assert sorted(r["global_step"] for r in results) == [3, 6]
    in_process = next(r for r in results if r["global_step"] == 6)
    # What was evaluated in process is the state in the file.
    from_file = evaluate(compose_eval([f"ckpt_path={last}", *FAST_PPL]))
    assert from_file == pytest.approx(in_process["metrics"], rel=1e-6)
    assert watch(tmp_path / "checkpoints", Counting(), once=True, settle_s=0, tag=["ppl"]) == []  # all done


class Recording:
    """An evaluate_fn that records (file name, global step, content) of each checkpoint it is given."""

    def __init__(self):
        self.calls = []

    def __call__(self, path, checkpoint):
        self.calls.append((path.name, checkpoint["global_step"], state_digest(checkpoint)))
        return {}

    def steps(self) -> list[int]:
        return sorted(step for _, step, _ in self.calls)


def test_watcher_evaluates_every_checkpoint_of_two_runs_and_never_mixes_them(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    train(compose_train(tiny_overrides(run, 4, 2)))
    train(compose_train(tiny_overrides(other, 4, 2, "seed=1")))
    ckpts = run / "checkpoints"
    own = state_digest(load_checkpoint(ckpts / "step000004.ckpt"))
    # Another run's checkpoint of the same step, copied in (older mtime: the watcher meets it first).
    shutil.copy2(other / "checkpoints" / "last.ckpt", ckpts / "copied.ckpt")
    first = Recording()
    watch(ckpts, first, once=True, settle_s=0, tag=["t"])
    assert sorted(first.calls) == [
        ("copied.ckpt", 4, state_digest(load_checkpoint(ckpts / "copied.ckpt"))),
        ("step000004.ckpt", 4, own),
    ]
    marker = json.loads((results_dir(ckpts / "last.ckpt") / "done.json").read_text())
    assert marker["same_as"] == "step000004.ckpt"  # the same state saved twice is evaluated once

    # A second run in the same folder (the first one's checkpoints deleted, its results kept) is evaluated too.
    for path in ckpts.glob("*.ckpt"):
        path.unlink()
    train(compose_train(tiny_overrides(run, 4, 2, "seed=2")))
    second = Recording()
    watch(ckpts, second, once=True, settle_s=0, tag=["t"])
    assert [(name, step) for name, step, _ in second.calls] == [("step000004.ckpt", 4)]
    assert second.calls[0][2] != own


def test_watcher_reports_missed_checkpoints_and_keep_mode_misses_none(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="callbacks.watch")
    plain = tmp_path / "plain" / "checkpoints"
    train(compose_train(tiny_overrides(plain.parent, 6, 2)))  # saves at 2, 4, 6; last.ckpt replaced each time
    seen = Recording()
    watch(plain, seen, once=True, settle_s=0)
    missed = sorted({2, 4, 6} - set(seen.steps()))
    assert missed, "nothing was replaced or rotated away"
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Missed")]
    assert f"step(s) {', '.join(map(str, missed))} " in warning and "keep_unevaluated=true" in warning

    caplog.clear()
    kept = tmp_path / "kept" / "checkpoints"
    keep = "callbacks.model_checkpoint.keep_unevaluated=true"
    train(compose_train(tiny_overrides(kept.parent, 6, 2, keep)))
    queued = sorted(p.name for p in (kept / "unevaluated").glob("*.ckpt"))
    assert queued == [f"step{s:06d}.ckpt" for s in missed]  # what the plain run lost is waiting here
    every = Recording()
    watch(kept, every, once=True, settle_s=0)
    assert every.steps() == [2, 4, 6] and not caplog.records
    assert not (kept / "unevaluated").exists()  # deleted once evaluated
    assert all((results_dir(kept / f"step{s:06d}.ckpt") / "done.json").is_file() for s in missed)

    # Evaluated checkpoints rotate away as usual.
    resume = [f"run_dir={kept.parent}", "ckpt_path=last", "trainer.max_steps=8"]
    train(compose_train(resume), resume)
    assert not (kept / "unevaluated").exists()


def test_a_corrupt_last_checkpoint_gives_one_clear_error_everywhere(tmp_path, caplog):
    train(compose_train(tiny_overrides(tmp_path, 2, 2)))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    expected = f"Checkpoint {last} is corrupt or truncated and cannot be loaded"
    resume = [f"run_dir={tmp_path}", "ckpt_path=last"]
    with pytest.raises(CorruptCheckpointError, match=expected):  # train.py, before building anything
        train(compose_train(resume), resume)
    with pytest.raises(CorruptCheckpointError, match=expected):  # Lightning's own loading goes through it too
        AtomicCheckpointIO().load_checkpoint(last)
    with pytest.raises(CorruptCheckpointError, match=expected):
        evaluate(compose_eval([f"ckpt_path={last}", *FAST_PPL]))
    caplog.set_level(logging.ERROR, logger="callbacks.watch")
    watch(last.parent, Counting(), once=True, settle_s=0)
    assert any(r.getMessage().startswith(f"Skipping checkpoint: {expected}") for r in caplog.records)
