"""Weights & Biases: a logger that goes offline by itself when there is no API key or no network, and the charts
and summary entries a researcher looks for on the run's dashboard."""

from __future__ import annotations

import logging
import netrc
import os
import socket
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import WandbLogger

from callbacks.babilong_eval import METRIC, size_key

log = logging.getLogger(__name__)


def wandb_online() -> bool:
    """True when W&B can log live: not forced offline, an API key exists, and the server is reachable."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return False
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    if not has_key:
        try:
            has_key = netrc.netrc().authenticators("api.wandb.ai") is not None
        except (FileNotFoundError, netrc.NetrcParseError):
            has_key = False
    if not has_key:
        return False
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
        return True
    except OSError:
        return False


def build_wandb_logger(
    project: str, save_dir: str, name: str | None = None, tags: list | None = None, id: str | None = None
) -> WandbLogger:
    """`id` continues an existing run (evaluate.py logs into the training run)."""
    online = wandb_online()
    if not online:
        os.environ["WANDB_MODE"] = "offline"
        log.warning(
            "W&B runs offline (no API key or no network). Upload later with: wandb sync %s/wandb/offline-run-*",
            Path(save_dir).resolve(),
        )
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    return WandbLogger(
        project=project, name=name, save_dir=save_dir, offline=not online, tags=list(tags or []), id=id
    )


class WandbDashboard(L.Callback):
    """What the W&B dashboard shows beyond Lightning's scalars: BABILong validation accuracy per length as one line
    chart over steps (`val/accuracy_by_length`, its history kept in checkpoints), and the run's checkpoint paths
    in the run summary (`checkpoint/last`, `checkpoint/best`). Does nothing without a WandbLogger."""

    def __init__(self):
        self.history: dict[str, list[tuple[int, float]]] = {}  # "qa1@2seg" -> [(step, accuracy)]

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logger = wandb_logger(trainer)
        if logger is None or trainer.sanity_checking:
            return
        step = trainer.global_step
        for key, value in trainer.callback_metrics.items():
            m = METRIC.match(key)
            if m and m["split"] == "val":
                self.history.setdefault(f"{m['task']}@{m['size']}", []).append((step, float(value)))
        if not self.history:
            return
        import wandb

        names = sorted(self.history, key=lambda n: (n.split("@")[0], size_key(n.split("@")[1])))
        chart = wandb.plot.line_series(
            xs=[[s for s, _ in self.history[n]] for n in names],
            ys=[[v for _, v in self.history[n]] for n in names],
            keys=names,
            title="Validation accuracy by length",
            xname="step",
        )
        logger.experiment.log({"val/accuracy_by_length": chart, "trainer/global_step": step})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        logger, ckpt = wandb_logger(trainer), trainer.checkpoint_callback
        if logger is None or ckpt is None or not ckpt.dirpath:
            return
        paths = {"checkpoint/last": str((Path(ckpt.dirpath) / "last.ckpt").resolve())}
        if getattr(ckpt, "best_model_path", ""):
            paths["checkpoint/best"] = str(Path(ckpt.best_model_path).resolve())
        logger.experiment.summary.update(paths)

    def state_dict(self) -> dict:
        return {"history": {k: [list(p) for p in v] for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: [(int(s), float(v)) for s, v in pts] for k, pts in state["history"].items()}


def wandb_logger(trainer: L.Trainer) -> WandbLogger | None:
    """The trainer's WandbLogger on global rank zero (None elsewhere, or without one)."""
    found = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    return found[0] if found and trainer.is_global_zero else None
