"""End-to-end training of tiny models through train.py's `train(cfg)`: learning, logging, errors, DDP."""

import csv
import ctypes
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize
from hydra.utils import instantiate

from callbacks.checkpoint import CorruptCheckpointError
from models.builders import build_run, load_init_from, register_resolvers, set_threads
from models.config_errors import ConfigError
from tests.wandb_reader import read_offline_run
from train import train

ROOT = Path(__file__).parents[1]
TINY = [
    "experiment=tiny_lm",
    "backbone.hidden_size=32",
    "backbone.ffn_size=64",
    "task.seq_len=32",
    "task.batch_size=4",
    "task.val_batches=4",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
register_resolvers()


def compose_train(overrides):
    with initialize(config_path="../configs", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def csv_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    (path,) = glob.glob(str(run_dir / "csv" / "version_*" / "metrics.csv"))
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k not in ("step", "epoch") and v:
                    out.setdefault(k, []).append((int(row["step"]), float(v)))
    return out


def test_tiny_lm_learns_and_writes_checkpoints(tmp_path):
    cfg = compose_train(
        TINY
        + [
            "trainer.max_steps=40",
            "trainer.val_check_interval=20",
            "optim.warmup_steps=5",
            f"run_dir={tmp_path}",
        ]
    )
    train(cfg)
    ppl = [v for _, v in csv_metrics(tmp_path)["val/ppl"]]
    assert len(ppl) == 2 and ppl[-1] < 0.2 * 32000, ppl  # from uniform over 32k tokens to far below it
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["config"]["backbone"]["hidden_size"] == 32 and ckpt["global_step"] == 40


def test_init_from_starts_a_new_run_from_a_checkpoints_weights(tmp_path, caplog):
    first = tmp_path / "first"
    train(compose_train(TINY + ["trainer.max_steps=5", "trainer.val_check_interval=5", f"run_dir={first}"]))
    ckpt = first / "checkpoints" / "last.ckpt"
    run = build_run(compose_train(TINY + [f"init_from={ckpt}", f"run_dir={tmp_path / 'second'}"]))
    checkpoint = torch.load(ckpt, weights_only=True)
    saved = checkpoint["state_dict"]
    state = run.module.model.state_dict()
    assert state.keys() == {k.removeprefix("model.") for k in saved}
    assert all(
        torch.equal(v, saved[f"model.{k}"]) for k, v in state.items()
    )  # the trained weights, not a fresh init
    with pytest.raises(ConfigError, match=r"init_from=.*give the same model= and backbone= options"):
        build_run(
            compose_train(TINY + [f"init_from={ckpt}", "backbone.ffn_size=48", f"run_dir={tmp_path / 'x'}"])
        )
    assert "other model options" not in caplog.text
    build_run(compose_train(TINY + [f"init_from={ckpt}", "model.stride=8", f"run_dir={tmp_path / 'y'}"]))
    assert (
        "other model options (model.stride: None in the checkpoint, 8 now)" in caplog.text
    )  # same shapes, named
    caplog.clear()
    now = checkpoint["config"]
    now["model"] |= {"k2": 31, "checkpoint_segments": True}  # how it trains, not what it computes: no warning
    load_init_from(run.module.model, str(ckpt), now)
    assert "other model options" not in caplog.text


def test_wandb_offline_run_holds_metrics_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(
        compose_train(
            TINY
            + [
                "logger=wandb",
                "trainer.max_steps=4",
                "trainer.val_check_interval=2",
                "trainer.log_every_n_steps=1",
                f"run_dir={tmp_path}",
            ]
        )
    )
    import wandb

    wandb.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    config, history = read_offline_run(Path(run_file))
    assert config["backbone"]["hidden_size"] == 32 and config["optim"]["lr"] == 3e-3
    keys = set().union(*history)
    assert {"train/loss", "val/ppl", "trainer/global_step"} <= keys


def test_llama_83m_has_83m_parameters():
    cfg = compose_train(["model=llama", "task=lm"])
    assert cfg.backbone.hidden_size == 512
    n = sum(p.numel() for p in instantiate(cfg.backbone).parameters())
    assert abs(n - 83e6) < 1e6, n


def test_tokenizer_vocabulary_mismatch_is_explained(tmp_path):
    with pytest.raises(ValueError, match=r"Tokenizer/vocabulary mismatch.*backbone.vocab_size=32000"):
        train(compose_train(TINY + ["backbone.vocab_size=1000", f"run_dir={tmp_path}"]))


def test_missing_corpus_path_is_explained(tmp_path):
    with pytest.raises(ValueError, match="corpus=folder needs corpus.path"):
        train(compose_train(TINY + ["corpus=folder", f"run_dir={tmp_path}"]))


def test_corrupt_checkpoint_is_explained(tmp_path):
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(CorruptCheckpointError, match="corrupt or truncated"):
        train(compose_train(TINY + [f"ckpt_path={bad}", f"run_dir={tmp_path}"]))


def test_ddp_two_cpu_processes(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline"}
    cmd = [
        sys.executable,
        "train.py",
        *TINY,
        "trainer=ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        f"run_dir={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert "world_size: 2" in res.stderr + res.stdout or "distributed_backend=gloo" in res.stderr + res.stdout


class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc only (mallopt / mallinfo2)")
def test_a_cpu_run_keeps_big_freed_blocks_for_the_next_step():
    """Was: every block over 32 MB (a tiny LM's 524 MB of logits) was unmapped when freed and page-faulted back in
    by the next step: about half of the step was system time (bench.malloc: 1.7x faster with them kept)."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    set_threads(None, torch.nn.Linear(2, 2), cuda=False)  # what train.py and evaluate.py call on the CPU
    size = 256 << 20
    x = torch.ones(size, dtype=torch.uint8)
    assert mallinfo2().hblkhd < size  # from the heap, not a block of its own mapping
    del x
    assert mallinfo2().fordblks >= size  # freed into the heap, kept for reuse
