"""Train any model of the framework: `python train.py model=rmt_r task=qa1` (see configs/ for every option)."""

from __future__ import annotations

import logging
import os

import hydra
from omegaconf import DictConfig

from models import cli
from models.builders import build_run, register_resolvers, resolve_ckpt_path

log = logging.getLogger("train")
register_resolvers()


def train(cfg: DictConfig) -> dict:
    """Build everything from the composed config, fit, and return the final metrics."""
    run = build_run(cfg)
    ckpt = resolve_ckpt_path(cfg.ckpt_path, cfg.run_dir)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt)
    if cfg.get("test"):
        run.trainer.test(run.module, datamodule=run.datamodule)
    return {k: float(v) for k, v in run.trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path=str(cli.CONFIGS), config_name="train")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with cli.user_errors(cfg):
        metrics = train(cfg)
    log.info("final metrics: %s", {k: round(v, 4) for k, v in sorted(metrics.items())})
    cli.report_outputs(cfg.run_dir)


if __name__ == "__main__":
    cli.run(main, "train")
