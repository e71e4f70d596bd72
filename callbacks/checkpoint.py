"""Checkpoint files: written whole or not at all, finite, loaded one way, rotated without losing unevaluated work.

- Writing (`AtomicCheckpointIO`): to `.<name>.tmp<pid>` in the same folder, then renamed. A failed write removes its
  partial file (a full disk says how much space it needs); partial files of killed writers are removed when the next
  run starts. A state holding NaN/inf (weights or optimizer) is never written: the previous checkpoints stay the last
  good ones.
- Loading (`load_checkpoint`): `weights_only=True` (a checkpoint cannot run code when loaded), one clear error per
  problem (missing, corrupt or truncated, not plain data) for every entry point: train resume, evaluate, watch.
- Rotation (`LastAndBestCheckpoint`): `last.ckpt` is the newest state and `step<N>.ckpt` the best; the folder holds
  nothing else of ours (no `-v1` copies, no stale best files). With `keep_unevaluated`, a checkpoint that a watcher
  (`evaluate.py watch=RUN_DIR`) has not marked done is hard-linked into `unevaluated/` before it is replaced or
  deleted; the watcher evaluates it there and then deletes it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from models.config_errors import ConfigError
from models.errors import UserError

log = logging.getLogger(__name__)

KEPT_DIR = "unevaluated"  # keep_unevaluated=true: checkpoints waiting for the watcher
TEMPORARY = re.compile(r"^\..+\.tmp(\d+)$")  # `.<name>.tmp<pid>`: a write in progress (or a killed writer's)


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint file that cannot be read (truncated, corrupt, not a checkpoint)."""


class MissingCheckpointError(UserError, FileNotFoundError):
    pass


class UnsafeCheckpointError(UserError):
    pass


class DiskFullError(UserError, OSError):
    pass


class DivergedError(UserError, FloatingPointError):
    pass


def load_checkpoint(path: str | Path, map_location="cpu", mmap: bool = False) -> dict:
    """Load a framework checkpoint with `weights_only=True`, with one clear error for a missing, corrupt or unsafe
    file (`mmap`: tensors are read lazily, e.g. to read only the step)."""
    path = Path(path)
    if not path.is_file():
        raise MissingCheckpointError(
            f"Checkpoint not found: {path}. Give an existing .ckpt file, e.g. RUN_DIR/checkpoints/last.ckpt."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if not re.search(r"weights.only", str(e), re.IGNORECASE):
            raise CorruptCheckpointError(corrupt_message(path, e)) from e
        raise UnsafeCheckpointError(
            f"Refusing to load {path}: it holds Python objects, not only tensors and plain data, and loading it could "
            "run code. Checkpoints of this framework never do; use one written by train.py."
        ) from None
    except Exception as e:  # torch raises many types for truncated/corrupt zip archives
        raise CorruptCheckpointError(corrupt_message(path, e)) from e


def model_weights(checkpoint: dict, path: str | Path) -> dict[str, torch.Tensor]:
    """The task model's weights: the `model.`-prefixed entries of the Lightning state_dict, prefix removed."""
    state = {
        k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")
    }
    if not state:
        raise ConfigError(f"{path} has no `model.*` weights in its state_dict.")
    return state


def corrupt_message(path: Path, e: Exception) -> str:
    return (
        f"Checkpoint {path} is corrupt or truncated and cannot be loaded ({type(e).__name__}: {e}). "
        "Use another checkpoint (e.g. checkpoints/last.ckpt) or delete this file."
    )


def state_tensors(checkpoint: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the weights and the optimizer state: what must stay finite."""

    def walk(node, name: str):
        if isinstance(node, torch.Tensor):
            yield name, node
        elif isinstance(node, dict):
            for k, v in node.items():
                yield from walk(v, f"{name}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                yield from walk(v, f"{name}.{i}")

    for key in ("state_dict", "optimizer_states"):
        yield from walk(checkpoint.get(key, {}), key)


def non_finite(checkpoint: dict) -> list[str]:
    return [
        n for n, t in state_tensors(checkpoint) if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, atomic and finite on save and through `load_checkpoint` on load."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        bad = non_finite(checkpoint)
        if bad:
            raise DivergedError(
                f"Not saving {path}: the state at global step {checkpoint.get('global_step')} holds NaN/inf "
                f"({len(bad)} tensors, e.g. {', '.join(bad[:3])}). Training diverged; the checkpoints already in "
                f"{path.parent} are the last good states. Lower the learning rate (optim.lr) and resume from one."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, (OSError, RuntimeError)):
                raise_if_disk_full(e, path, sum(t.nbytes for _, t in state_tensors(checkpoint)))
            raise

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return load_checkpoint(path, map_location=map_location)


def raise_if_disk_full(e: Exception, path: Path, need: int) -> None:
    """A write failed: if for lack of space (ENOSPC, or torch's `unexpected pos` with less free space than the
    checkpoint needs), say so instead of the raw error."""
    free = shutil.disk_usage(path.parent).free
    if getattr(e, "errno", None) == errno.ENOSPC or free < need:
        raise DiskFullError(
            f"No space left on {path.parent}: need ~{need / 2**20:.0f} MB for {path.name}, {free / 2**20:.0f} MB "
            f"free. {path.name} was not written and the previous checkpoints are kept; free some space and resume "
            "with ckpt_path=last."
        ) from e


def remove_stale_temporaries(folder: Path) -> None:
    """Delete the partial files (`.<name>.tmp<pid>`) of writers that died mid-save (killed, out of memory, ...)."""
    for path in folder.glob(".*.tmp*"):
        match = TEMPORARY.match(path.name)
        if match and (int(match[1]) == os.getpid() or not process_alive(int(match[1]))):
            log.info("Removing %s, the partial file of a writer that died", path)
            path.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# ---- the watcher's done markers (callbacks/watch.py writes them) ------------------------------------------------
def results_suffix(window: int | None = None) -> str:
    """What follows a checkpoint's file name in the name of its results folder: `.eval`, or `.window<W>.eval`."""
    return ".eval" if window is None else f".window{int(window)}.eval"


def results_dir(ckpt: str | Path, window: int | None = None) -> Path:
    """Where a checkpoint's evaluation results go: `<ckpt>.eval/` beside it (for one kept in `unevaluated/`,
    beside the other checkpoints), or `<ckpt>.window<W>.eval/` when it is streamed through another window
    (evaluate.py window=W), so the two never overwrite each other."""
    ckpt = Path(ckpt)
    folder = ckpt.parent.parent if ckpt.parent.name == KEPT_DIR else ckpt.parent
    return folder / (ckpt.name + results_suffix(window))


def evaluated_checkpoint(folder: Path) -> tuple[Path | None, int | None]:
    """The checkpoint whose results `folder` holds and the window it was streamed through (`x.ckpt.eval`: None,
    `x.ckpt.window<W>.eval`: W), the inverse of `results_dir`; (None, None) for an out_dir."""
    name, ext, rest = folder.name.partition(".ckpt")
    if not (ext and rest.endswith(".eval")):
        return None, None
    window = rest.removesuffix(".eval").removeprefix(".window")
    return folder.with_name(name + ext), int(window) if window else None


def file_identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_marker(ckpt: Path, window: int | None = None) -> dict | None:
    try:
        return json.loads((results_dir(ckpt, window) / "done.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def keep_if_unevaluated(path: Path) -> None:
    """Before `path` is replaced or deleted: hard-link it into `unevaluated/` as `step<N>.ckpt`, unless a watcher
    has marked it done or that step is kept already."""
    if not path.is_file() or (read_marker(path) or {}).get("identity") == file_identity(path):
        return
    try:
        name = f"step{int(load_checkpoint(path, mmap=True)['global_step']):06d}.ckpt"
    except UserError:  # corrupt: nothing to keep
        return
    kept = path.parent / KEPT_DIR / name
    if kept.exists() or (path.name != name and (path.parent / name).exists()):
        return
    kept.parent.mkdir(exist_ok=True)
    try:
        os.link(path, kept)
    except OSError:  # no hard links on this filesystem
        shutil.copy2(path, kept)
    log.info("Kept %s for the watcher as %s", path.name, kept)


class LastAndBestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose last.ckpt is the newest state: written at every validation and at the end of training.
    (Lightning >= 2.5 rewrites last.ckpt only at steps where a best-by-monitor checkpoint was saved, so a run whose
    metric stopped improving would resume from its best step, not from where it stopped.)

    Names never get a version suffix (`last-v1.ckpt`): a run folder holds one run. After each save the folder keeps
    only the best `step*.ckpt` files (stale ones of a killed run's lost steps go). Every checkpoint records the steps
    this run saved (`saved_steps`), so a watcher can tell which it missed."""

    def __init__(self, *args, keep_unevaluated: bool = False, **kwargs):
        super().__init__(*args, enable_version_counter=False, **kwargs)
        self.keep_unevaluated = keep_unevaluated
        self.saved_steps: list[int] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and stage == "fit" and Path(self.dirpath).is_dir():
            remove_stale_temporaries(Path(self.dirpath))

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_new(trainer)
        self._remove_stale_best(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_new(trainer)
        self._remove_stale_best(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["saved_steps"] = list(self.saved_steps)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.saved_steps = [int(s) for s in checkpoint.get("saved_steps", [])]

    def _save_last_if_new(self, trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # skips a step already saved, sanity checks, ...
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if trainer.global_step not in self.saved_steps:
            self.saved_steps.append(trainer.global_step)
        if self.keep_unevaluated and trainer.is_global_zero:
            keep_if_unevaluated(Path(filepath))
        super()._save_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        if self.keep_unevaluated and trainer.is_global_zero:
            keep_if_unevaluated(Path(filepath))
        super()._remove_checkpoint(trainer, filepath)

    def _remove_stale_best(self, trainer) -> None:
        """Remove `step*.ckpt` files that are not (any longer) among the best, except the one resumed from."""
        if self.save_top_k < 0 or not trainer.is_global_zero or not Path(self.dirpath).is_dir():
            return
        keep = {*self.best_k_models, self.best_model_path, self.last_model_path, trainer.ckpt_path}
        keep = {Path(p).resolve() for p in keep if p}
        prefix = self.filename.split("{")[0]
        for path in Path(self.dirpath).glob(f"{prefix}*{self.FILE_EXTENSION}"):
            if path.resolve() not in keep:
                self._remove_checkpoint(trainer, str(path))


def best_checkpoint_line(trainer) -> str | None:
    """`best checkpoint by MONITOR: PATH (V; last.ckpt: W)`, the file to evaluate besides last.ckpt (a curriculum's
    best can be far better than its end); None without a checkpoint callback, a monitor or a best file yet."""
    ckpt = trainer.checkpoint_callback
    if ckpt is None or not ckpt.monitor or not ckpt.best_model_path or ckpt.best_model_score is None:
        return None
    last = trainer.callback_metrics.get(ckpt.monitor)
    at_end = f"; last.ckpt: {float(last):.4g}" if last is not None else ""
    return f"best checkpoint by {ckpt.monitor}: {ckpt.best_model_path} ({float(ckpt.best_model_score):.4g}{at_end})"


def build_checkpoint_callback(
    dirpath: str,
    monitor: str | None = None,
    mode: str = "min",
    every_n_train_steps: int | None = None,
    keep_unevaluated: bool = False,
) -> ModelCheckpoint:
    """last.ckpt: the newest state (every validation and the end of training), plus the best checkpoint by
    `monitor` (train.py fills in the task's metric). `keep_unevaluated`: for `evaluate.py watch=RUN_DIR`, never
    replace or delete a checkpoint the watcher has not evaluated (it waits in `unevaluated/`)."""
    return LastAndBestCheckpoint(
        dirpath=dirpath,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        monitor=monitor,
        mode=mode,
        save_top_k=1 if monitor else 0,
        save_last=True,
        every_n_train_steps=every_n_train_steps,
        keep_unevaluated=keep_unevaluated,
    )
