"""Fault tolerance: a crashed or SIGKILLed run resumes exactly (same optimizer, scheduler and data stream), a NaN
loss stops with a clear message after saving the last good state, corrupt checkpoints fail clearly."""

import csv
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize
from omegaconf import DictConfig, OmegaConf
from torch import nn

from callbacks.checkpoint import (
    AtomicCheckpointIO,
    CorruptCheckpointError,
    DiskFullError,
    DivergedError,
    load_checkpoint,
    non_finite,
    state_tensors,
)
from models.builders import build_run, register_resolvers
from models.run_config import RunDirInUseError
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
    resume = [f"run_dir={tmp_path / 'b'}", "ckpt_path=last"]  # the run's saved config, nothing repeated
    train(compose_train(resume), resume)
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

    # Starting anew in the killed run's folder is refused and leaves its record alone; the README's resume command
    # (run_dir, ckpt_path=last and only what changes) continues it from its saved config.
    record = (killed / ".hydra" / "config.yaml").read_bytes()
    refused = subprocess.run(
        [sys.executable, "train.py", f"run_dir={killed}"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "holds the checkpoints of another run" in refused.stderr, (
        refused.stderr
    )
    assert (killed / ".hydra" / "config.yaml").read_bytes() == record
    assert not list((killed / "checkpoints").glob("last-v*.ckpt"))
    resume = ["train.py", f"run_dir={killed}", "ckpt_path=last", f"trainer.max_steps={step + 3}"]
    res = subprocess.run([sys.executable, *resume], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert OmegaConf.load(killed / ".hydra" / "config.yaml").backbone.hidden_size == 32  # the run's, not 83M
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


def assert_finite(path: Path) -> dict:
    """Every weight and every optimizer-state tensor of the checkpoint is finite (and there is optimizer state)."""
    state = load_checkpoint(path)
    tensors = dict(state_tensors(state))
    assert any(name.startswith("optimizer_states") for name in tensors), "no optimizer state saved"
    assert non_finite(state) == [], path
    return state


def test_diverging_learning_rate_leaves_a_finite_last_good_state(tmp_path):
    """lr=1e6: the update that would write NaN into the weights and the Adam moments is never made."""
    overrides = tiny_overrides(tmp_path, 50, 2, "optim.lr=1e6")
    with pytest.raises(DivergedError, match=r"(Loss|The gradient norm) is (nan|inf|-inf) at global step \d+"):
        train(compose_train(overrides))
    saved = tmp_path / "checkpoints" / "last-finite.ckpt"
    step = assert_finite(saved)["global_step"]
    for path in (tmp_path / "checkpoints").glob("*.ckpt"):  # no checkpoint of the run holds NaN/inf
        assert_finite(path)

    # The advised resume with the same learning rate diverges again at the same step and saves the same finite state.
    with pytest.raises(DivergedError, match=f"at global step {step}"):
        train(compose_train([*overrides, f"ckpt_path={saved}"]))
    assert assert_finite(saved)["global_step"] == step


def test_a_state_with_nan_is_never_written(tmp_path):
    train(compose_train(tiny_overrides(tmp_path, 2, 2)))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    state = load_checkpoint(last)
    next(iter(state["optimizer_states"][0]["state"].values()))["exp_avg_sq"][0] = float("inf")
    with pytest.raises(
        DivergedError, match=r"Not saving .*last.ckpt: the state at global step 2 holds NaN/inf"
    ):
        AtomicCheckpointIO().save_checkpoint(state, last)
    assert last.read_bytes() == before and not list(last.parent.glob(".*tmp*"))


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


def test_a_new_run_refuses_a_used_run_dir_and_changes_nothing_there(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    train(compose_train(tiny_overrides(run, 2, 2)))
    train(compose_train(tiny_overrides(other, 2, 2, "seed=1")))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert run / ".hydra" / "config.yaml" in before
    with pytest.raises(RunDirInUseError, match=rf"A new run cannot use run_dir={run}: .*ckpt_path=last"):
        train(compose_train(tiny_overrides(run, 4, 2)))
    with pytest.raises(RunDirInUseError, match=rf"A resume from {other}/checkpoints/last.ckpt cannot use"):
        train(compose_train(tiny_overrides(run, 4, 2, f"ckpt_path={other}/checkpoints/last.ckpt")))
    assert {
        p: p.read_bytes() for p in run.rglob("*") if p.is_file()
    } == before  # no last-v1.ckpt, no new config


def test_resume_takes_the_saved_config_and_only_the_given_overrides(tmp_path, caplog):
    """The run folder moved meanwhile: its paths move with it. optim.lr and seed change (with a warning) and the new
    learning rate is the one used; `experiment=` is not re-applied; nothing is written to the old place."""
    run, moved = tmp_path / "run", tmp_path / "moved"
    train(compose_train(tiny_overrides(run, 4, 2, "optim.stable_ratio=1.0")))
    run_id = load_checkpoint(run / "checkpoints" / "last.ckpt")["config"]["run_id"]
    shutil.move(run, moved)
    caplog.set_level(logging.WARNING, logger="models.run_config")
    resume = [
        f"run_dir={moved}",
        "ckpt_path=last",
        "trainer.max_steps=6",
        "optim.lr=1e-3",
        "seed=3",
        "experiment=tiny_lm",
    ]
    train(compose_train(resume), resume)

    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert "optim.lr: 0.003 -> 0.001; seed: 0 -> 3" in warnings and "backbone" not in warnings
    assert "experiment=tiny_lm is not applied to a resumed run" in warnings
    lrs = {step: v for (key, step), v in read_metrics(moved, "last").items() if key == "train/lr"}
    assert sorted(lrs) == [4, 5] and lrs[4] == pytest.approx(1e-3)
    assert sorted(p.name for p in (moved / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step000006.ckpt"]
    config = load_checkpoint(moved / "checkpoints" / "last.ckpt")["config"]
    assert config["backbone"]["hidden_size"] == 32 and config["run_id"] == run_id
    assert config["callbacks"]["model_checkpoint"]["dirpath"] == f"{moved}/checkpoints"
    assert not run.exists()


def test_partial_files_of_dead_writers_and_stale_best_files_are_removed(tmp_path):
    train(compose_train(tiny_overrides(tmp_path, 4, 2)))
    ckpts = tmp_path / "checkpoints"
    done = subprocess.Popen(["true"])
    done.wait()
    dead, alive = ckpts / f".last.ckpt.tmp{done.pid}", ckpts / f".last.ckpt.tmp{os.getppid()}"
    stale = ckpts / "step000003.ckpt"  # the best file of a step a killed run lost
    for path in (dead, alive, stale):
        shutil.copy(ckpts / "last.ckpt", path)
    resume = [f"run_dir={tmp_path}", "ckpt_path=last", "trainer.max_steps=6"]
    train(compose_train(resume), resume)
    assert not dead.exists() and alive.exists() and not stale.exists()
    assert len(list(ckpts.glob("step*.ckpt"))) == 1  # save_top_k=1: one best file


def test_a_full_disk_keeps_the_previous_checkpoint_and_leaves_no_partial_file(tmp_path, monkeypatch):
    train(compose_train(tiny_overrides(tmp_path, 2, 2)))
    ckpts = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.glob("*.ckpt")}

    def full_disk_save(obj, f):  # what torch's zip writer does when the disk fills up
        Path(f).write_bytes(b"PK\x03\x04" + bytes(1000))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1004")

    monkeypatch.setattr(torch, "save", full_disk_save)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 2**20, 2**20)
    )
    resume = [f"run_dir={tmp_path}", "ckpt_path=last", "trainer.max_steps=4"]
    with pytest.raises(
        DiskFullError, match=rf"No space left on {ckpts}: need ~2\d MB for step000004.ckpt, 1 MB free"
    ):
        train(compose_train(resume), resume)
    assert {p.name: p.read_bytes() for p in ckpts.glob("*.ckpt")} == before  # the previous checkpoints stay
    assert load_checkpoint(ckpts / "last.ckpt")["global_step"] == 2
    assert not [p for p in ckpts.iterdir() if ".tmp" in p.name]
