"""Checkpoints that are never half-written: saved to a temporary name in the same folder, then renamed."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from models.config_errors import MissingFileError
from models.errors import UserError


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint file that cannot be read (truncated, corrupt, not a checkpoint)."""


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Load a framework checkpoint (weights_only first), with one clear error for missing/corrupt files."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(
            f"Checkpoint not found: {path}. Give an existing .ckpt file, e.g. RUN_DIR/checkpoints/last.ckpt."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for truncated/corrupt zip archives
        raise CorruptCheckpointError(
            f"Checkpoint {path} is corrupt or truncated and cannot be loaded ({type(e).__name__}: {e}). "
            "Use another checkpoint (e.g. checkpoints/last.ckpt) or delete this file."
        ) from e


class LastAndBestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose last.ckpt is the newest state: written at every validation and at the end of training.
    (Lightning >= 2.5 rewrites last.ckpt only at steps where a best-by-monitor checkpoint was saved, so a run whose
    metric stopped improving would resume from its best step, not from where it stopped.)"""

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_new(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_new(trainer)

    def _save_last_if_new(self, trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # skips a step already saved, sanity checks, ...
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def build_checkpoint_callback(
    dirpath: str, monitor: str | None = None, mode: str = "min", every_n_train_steps: int | None = None
) -> ModelCheckpoint:
    """last.ckpt: the newest state (every validation and the end of training), plus the best checkpoint by
    `monitor` (train.py fills in the task's metric)."""
    return LastAndBestCheckpoint(
        dirpath=dirpath,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        monitor=monitor,
        mode=mode,
        save_top_k=1 if monitor else 0,
        save_last=True,
        every_n_train_steps=every_n_train_steps,
    )
