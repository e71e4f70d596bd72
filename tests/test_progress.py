"""A run you can follow: plain progress lines when output goes to a file, where things were written at the end,
a step-counted bar on a terminal (also after a resume), and none of Lightning's or W&B's noise."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from callbacks import progress
from callbacks.progress import progress_line
from models import cli
from models.builders import build_run
from tests.test_faults import compose_train, tiny_overrides
from train import train

ROOT = Path(__file__).parents[1]
TINY = ["experiment=tiny_lm", "backbone.hidden_size=32", "backbone.ffn_size=64", "task.seq_len=32"]


def test_output_to_a_file_gets_progress_lines_where_things_went_and_no_noise(tmp_path):
    """`python train.py ... > log.txt`: was silent until the end, with `Epoch 0/-2`, Lightning's tips and a
    deprecation warning, and W&B's colour codes."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "callbacks.progress_log.every_n_steps=2",
        "test=true",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "TERM": "xterm-256color"}
    with open(tmp_path / "log.txt", "w") as out:
        cmd = [sys.executable, "train.py", *args, "logger=[csv,wandb]", f"run_dir={run_dir}"]
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    log = (tmp_path / "log.txt").read_text()
    assert res.returncode == 0, log[-3000:]
    steps = re.findall(
        r"step (\d)/6 \(\d+%\) \| loss [\d.]+ \| [\d,]+ tok/s \| 0:00:\d\d elapsed, ETA 0:00:\d\d", log
    )
    assert steps == ["2", "4", "6"], log
    vals = re.findall(r"validation at step (\d): val/loss ([\d.]+), val/ppl [\d.e+]+", log)
    assert [step for step, _ in vals] == ["3", "6"]
    # which checkpoint to evaluate besides last.ckpt: the best by the monitor, its value and the last one's
    best = re.search(
        r"best checkpoint by val/loss: (\S+/step00000(\d)\.ckpt) \(([\d.]+); last\.ckpt: ([\d.]+)\)", log
    )
    losses = {step: float(v) for step, v in vals}
    assert best and Path(best[1]).is_file(), log
    assert float(best[3]) == min(losses.values()) == losses[best[2]] and float(best[4]) == losses["6"]
    # the test set's metrics on one line, not Lightning's table (which repeats them under every dataloader)
    assert re.search(r"test: test/loss [\d.]+, test/ppl [\d.e+]+", log)
    assert f"Run folder: {run_dir}" in log  # at the start
    written = log.split(f"Written under {run_dir}:")[1]  # at the end
    assert (
        "checkpoints/: last.ckpt, step000006.ckpt" in written
        and "csv/version_0/: hparams.yaml, metrics.csv" in written
    )
    assert re.search(r"wandb/offline-run-\S+: upload with `wandb sync \S+/wandb/offline-run-", written)
    assert re.search(r"wall time 0:0\d:\d\d \(all of it", log)  # the whole run's time, at its end
    for noise in ("Epoch", "Tip:", "LeafSpec", "\x1b[", "Traceback", "DataLoader"):
        assert noise not in log, noise


def test_step_bar_counts_optimizer_steps_after_a_resume(tmp_path, monkeypatch):
    """Was `60/10` after resuming at step 60 of 70 (batches since the resume over the steps left)."""
    train(compose_train(tiny_overrides(tmp_path, 4, 2)))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # a terminal: the rich bar, not the log lines
    overrides = [o for o in tiny_overrides(tmp_path, 6, 2, "ckpt_path=last") if "progress_bar" not in o]
    run = build_run(compose_train(overrides))
    bar = run.trainer.progress_bar_callback
    assert type(bar).__name__ == "StepProgressBar"
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=str(tmp_path / "checkpoints/last.ckpt"))
    (training,) = [t for t in bar.progress.tasks if t.description.startswith("Training")]
    assert (training.completed, training.total) == (6, 6)
    assert not any("Epoch" in t.description for t in bar.progress.tasks)


def test_progress_line_names_step_loss_rate_eta_and_curriculum_stage():
    trainer = SimpleNamespace(
        max_steps=400,
        callback_metrics={"train/loss": 2.3456, "train/tokens_per_s": 14210.4},
        datamodule=SimpleNamespace(stage=1, max_segments=2),
    )
    line = progress_line(
        trainer, step=100, elapsed=65.0, done=50
    )  # 50 steps since the (resumed) start in 65 s
    assert (
        line
        == "step 100/400 (25%) | loss 2.346 | 14,210 tok/s | 0:01:05 elapsed, ETA 0:06:30 | curriculum stage 1: 2 segments"
    )
    trainer.datamodule.stage, trainer.datamodule.max_segments = 0, 0
    assert progress_line(trainer, 100, 65.0, 50).endswith("curriculum stage 0: facts only")


def test_report_lists_what_this_process_wrote(tmp_path, caplog):
    """The end of train.py / evaluate.py: checkpoints, CSVs, plots and JSON, the W&B folder with its sync command;
    files from before this process (an earlier run in the same folder) are not listed."""
    for name in ["checkpoints/last.ckpt", "checkpoints/last.ckpt.eval/metrics.json", "eval/version_0/metrics.csv",
                 *[f"forgetting/step{i}.png" for i in range(5)], "wandb/offline-run-1-abc/run-abc.wandb",
                 "checkpoints/.last.ckpt.tmp123", "old.png"]:  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    os.utime(tmp_path / "old.png", (cli.STARTED - 3600, cli.STARTED - 3600))
    with caplog.at_level(logging.INFO, logger="memlm"):
        cli.report_outputs(tmp_path)
    assert caplog.messages == [
        f"Written under {tmp_path}:\n"
        "  checkpoints/: last.ckpt\n"
        "  checkpoints/last.ckpt.eval/: metrics.json\n"
        "  eval/version_0/: metrics.csv\n"
        "  forgetting/: 5 files (.png)\n"
        f"  wandb/offline-run-1-abc: upload with `wandb sync {tmp_path}/wandb/offline-run-1-abc`"
    ]


def test_track_logs_count_rate_and_eta_when_not_on_a_terminal(monkeypatch, caplog):
    """A long evaluation (100 samples at 1M tokens) in a log file said nothing until it ended."""
    clock_now = iter(range(0, 1000, 10))  # every item takes 10 s
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock_now))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="callbacks.progress"):
        assert list(progress.track(range(8), "babilong qa1 @ 1M", every_s=25)) == list(range(8))
    assert [r.getMessage() for r in caplog.records] == [
        "babilong qa1 @ 1M: 3/8 (38%) | 0.1 it/s | 0:00:30 elapsed, ETA 0:00:50",
        "babilong qa1 @ 1M: 6/8 (75%) | 0.1 it/s | 0:01:00 elapsed, ETA 0:00:20",
        "babilong qa1 @ 1M: 8/8 (100%) | 0.1 it/s | 0:01:20 elapsed, ETA 0:00:00",
    ]
