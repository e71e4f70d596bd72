"""Train any model of the framework: `python train.py model=rmt_r task=qa1` (see configs/ for every option)."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from callbacks.checkpoint import best_checkpoint_line
from callbacks.progress import metrics_line
from models import cli
from models.builders import build_run, register_resolvers
from models.run_config import prepare_run, save_run_config

log = logging.getLogger("train")
register_resolvers()


def train(cfg: DictConfig, overrides: list[str] | None = None) -> dict:
    """Build everything from the composed config, fit, and return the final metrics. A resume (ckpt_path) takes the
    checkpoint's saved config with the command line's `overrides` (None: `cfg` is complete; models/run_config.py)."""
    cfg, ckpt = prepare_run(cfg, overrides)
    run = build_run(cfg)
    save_run_config(cfg, overrides)
    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt)
    metrics = dict(run.trainer.callback_metrics)  # trainer.test starts its own
    if run.trainer.is_global_zero and (best := best_checkpoint_line(run.trainer)):
        log.info(best)
    if cfg.get("test"):
        # not Lightning's table: with a test set per length it lists every metric under every dataloader
        run.trainer.test(run.module, datamodule=run.datamodule, verbose=False)
        log.info("test: %s", metrics_line(run.trainer.callback_metrics, "test/"))
        metrics |= run.trainer.callback_metrics
    return {k: float(v) for k, v in metrics.items()}


@hydra.main(version_base="1.3", config_path=str(cli.CONFIGS), config_name="train")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    with cli.user_errors(cfg):
        metrics = train(cfg, list(HydraConfig.get().overrides.task))
    log.info("final metrics: %s", {k: round(v, 4) for k, v in sorted(metrics.items())})
    log.info(
        "wall time %s (all of it: data, tokenizer or warm start built by this run included)",
        timedelta(seconds=round(time.perf_counter() - t0)),
    )
    cli.report_outputs(cfg.run_dir)


if __name__ == "__main__":
    cli.run(main, "train")
