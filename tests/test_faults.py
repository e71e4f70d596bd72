"""Fault tolerance: a crashed or SIGKILLed run resumes exactly (same optimizer, scheduler and data stream), a NaN
loss stops with a clear message after saving the last good state, corrupt checkpoints fail clearly."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize
from omegaconf import DictConfig
from torch import nn

from callbacks.checkpoint import CorruptCheckpointError, load_checkpoint
from models.builders import build_run, register_resolvers
from train import train

ROOT = Path(__file__).parents[1]
register_resolvers()


def tiny_overrides(run_dir: Path, max_steps: int, val_every: int, *extra: str) -> list[str]:
    """A ~2M-parameter Llama LM run: val (and last.ckpt) every `val_every` steps, every step's loss logged."""
    return [
        "experiment=tiny_lm",
        "task.seq_len=32",
        "task.batch_size=2",
        "task.val_batches=2",
        "backbone.hidden_size=32",
        "backbone.ffn_size=64",
        f"trainer.max_steps={max_steps}",
        f"trainer.val_check_interval={val_every}",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "~callbacks.progress_bar",
        "logger=csv",
        "optim.warmup_steps=2",
        f"run_dir={run_dir}",
        *extra,
    ]


def compose_train(overrides: list[str]) -> DictConfig:
    with initialize(config_path="../configs", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def read_metrics(run_dir: Path, version: str = "*") -> dict[tuple[str, int], float]:
    """{(metric, step): value} of the run's CSV logs (csv/version_N: one per start of the run; all by default,
    or the newest with version="last")."""
    out, paths = (
        {},
        sorted(
            (run_dir / "csv").glob(f"version_{'*' if version == 'last' else version}/metrics.csv"),
            key=lambda p: int(p.parent.name[8:]),
        ),
    )
    for path in paths[-1:] if version == "last" else paths:
        with open(path) as f:
            out.update(
                {
                    (k, int(row["step"])): float(v)
                    for row in csv.DictReader(f)
                    for k, v in row.items()
                    if v and k not in ("step", "epoch", "train/tokens_per_s")
                }
            )
    return out


def assert_same_metrics(reference: dict, resumed: dict, keys: set) -> None:
    assert keys, "nothing to compare"
    for key in sorted(keys):
        torch.testing.assert_close(resumed[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{key}")


def assert_same_state(a: Path, b: Path) -> None:
    """Same weights and the same AdamW moments (optimizer state survives the resume)."""
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca["global_step"] == cb["global_step"]
    torch.testing.assert_close(cb["state_dict"], ca["state_dict"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        cb["optimizer_states"][0]["state"], ca["optimizer_states"][0]["state"], rtol=1e-5, atol=1e-6
    )
    assert cb["lr_schedulers"][0]["last_epoch"] == ca["lr_schedulers"][0]["last_epoch"]


class CrashAt(L.Callback):
    """Dies at the start of the batch after `step` optimizer steps (the last checkpoint is older)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_crashed_run_resumes_like_an_uninterrupted_one(tmp_path):
    train(compose_train(tiny_overrides(tmp_path / "a", 8, 2)))
    reference = read_metrics(tmp_path / "a")

    run = build_run(compose_train(tiny_overrides(tmp_path / "b", 8, 2)))
    run.trainer.callbacks.append(CrashAt(5))  # last.ckpt is at step 4; step 4 (batch 5) is trained twice
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.trainer.fit(run.module, datamodule=run.datamodule)
    assert load_checkpoint(tmp_path / "b/checkpoints/last.ckpt")["global_step"] == 4
    before = read_metrics(tmp_path / "b", "0")
    train(compose_train(tiny_overrides(tmp_path / "b", 8, 2, "ckpt_path=last")))
    after = read_metrics(tmp_path / "b", "1")  # the resumed run logs to csv/version_1

    assert min(step for _, step in after) == 4  # resumed at the checkpoint, not from scratch
    assert_same_metrics(reference, before, set(before))
    assert_same_metrics(reference, after, set(after))
    assert set(before) | set(after) == set(reference)
    assert_same_state(tmp_path / "a/checkpoints/last.ckpt", tmp_path / "b/checkpoints/last.ckpt")


# max_steps 8: training ends at a validation step; 7: between validations
@pytest.mark.parametrize("max_steps", [8, 7])
def test_last_checkpoint_is_the_newest_state_even_when_the_metric_stops_improving(tmp_path, max_steps):
    # monitor a constant learning rate (warm-up done by step 2): only the first validation saves a "best"
    monitor = ["callbacks.model_checkpoint.monitor=train/lr", "callbacks.model_checkpoint.mode=max"]
    train(compose_train(tiny_overrides(tmp_path, max_steps, 2, "optim.stable_ratio=1.0", *monitor)))
    assert [p.name for p in (tmp_path / "checkpoints").glob("step*.ckpt")] == ["step000002.ckpt"]
    assert load_checkpoint(tmp_path / "checkpoints/last.ckpt")["global_step"] == max_steps


def test_sigkilled_run_resumes_from_last_checkpoint(tmp_path):
    """A real `kill -9` of `python train.py` after its first checkpoint; the resumed run matches a reference run.
    stable_ratio=1: the learning rate is then independent of max_steps (the killed run had a huge one)."""
    const_lr = "optim.stable_ratio=1.0"
    killed = tmp_path / "killed"
    cmd = [sys.executable, "train.py", *tiny_overrides(killed, 100_000, 3, const_lr)]
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    with open(tmp_path / "train.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        last = killed / "checkpoints" / "last.ckpt"
        deadline = time.monotonic() + 120
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "train.out").read_text()[-3000:]
    step = load_checkpoint(last)["global_step"]
    assert step > 0 and step % 3 == 0

    train(compose_train(tiny_overrides(killed, step + 3, 3, const_lr, "ckpt_path=last")))
    train(compose_train(tiny_overrides(tmp_path / "ref", step + 3, 3, const_lr)))
    resumed, reference = read_metrics(killed, "last"), read_metrics(tmp_path / "ref")
    assert {s for _, s in resumed} == {step, step + 1, step + 2}
    assert_same_metrics(reference, resumed, set(resumed))
    assert_same_state(tmp_path / "ref/checkpoints/last.ckpt", last)


class NaNAt(nn.Module):
    """The wrapped loss, except NaN on the call number `k` (0-based: optimizer step k)."""

    def __init__(self, loss: nn.Module, k: int):
        super().__init__()
        self.inner, self.k, self.calls = loss, k, 0

    def forward(self, out, model, batch):
        loss = self.inner(out, model, batch)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 == self.k else loss


def test_nan_loss_stops_with_message_and_saves_last_good_state(tmp_path):
    run = build_run(compose_train(tiny_overrides(tmp_path, 8, 2)))
    run.module.loss = NaNAt(run.module.loss, 3)
    with pytest.raises(FloatingPointError) as e:
        run.trainer.fit(run.module, datamodule=run.datamodule)
    saved = tmp_path / "checkpoints" / "last-finite.ckpt"
    assert f"Loss is nan at global step 3. The last good state was saved to {saved}" in str(e.value)
    assert "Lower the learning rate (optim.lr)" in str(e.value)
    state = load_checkpoint(saved)  # weights_only=True
    assert state["global_step"] == 3
    weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    torch.testing.assert_close(weights, run.module.model.state_dict())  # the weights before the NaN step
    assert all(torch.isfinite(v).all() for v in weights.values())

    # Resuming from it continues exactly like a run that never saw the NaN (same steps, validations, weights).
    train(compose_train(tiny_overrides(tmp_path, 6, 2, f"ckpt_path={saved}")))
    train(compose_train(tiny_overrides(tmp_path / "ref", 6, 2)))
    resumed, reference = read_metrics(tmp_path, "last"), read_metrics(tmp_path / "ref")
    assert {s for _, s in resumed} == {3, 4, 5}
    assert_same_metrics(reference, resumed, set(resumed))
    assert_same_state(tmp_path / "ref/checkpoints/last.ckpt", tmp_path / "checkpoints/last.ckpt")


def test_diverging_learning_rate_stops_with_message(tmp_path):
    with pytest.raises(FloatingPointError, match=r"Loss is (nan|inf|-inf) at global step \d+"):
        train(compose_train(tiny_overrides(tmp_path, 50, 25, "optim.lr=1e9", "optim.warmup_steps=1")))
    assert (tmp_path / "checkpoints" / "last-finite.ckpt").is_file()


def test_corrupt_checkpoint_gives_a_clear_error(tmp_path):
    train(compose_train(tiny_overrides(tmp_path, 2, 2)))
    good = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(good, weights_only=True)  # every checkpoint loads with weights_only=True
    assert {"config", "state_dict", "optimizer_states", "lr_schedulers"} <= set(state)
    bad = tmp_path / "checkpoints" / "truncated.ckpt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    expected = f"Checkpoint {bad} is corrupt or truncated and cannot be loaded"
    with pytest.raises(CorruptCheckpointError, match=expected):
        load_checkpoint(bad)
    with pytest.raises(CorruptCheckpointError, match=expected):  # before any training starts
        train(compose_train(tiny_overrides(tmp_path, 4, 2, f"ckpt_path={bad}")))
