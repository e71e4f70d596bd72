"""Weights & Biases logger that goes offline by itself when there is no API key or no network."""

from __future__ import annotations

import logging
import netrc
import os
import socket
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger

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
