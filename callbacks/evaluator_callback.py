"""Run an evaluator (forgetting curve, LongPPL, ...) during training, every N validations.

The evaluator sees the trained task model with the datamodule's tokenizer and corpus (`trainer.datamodule.
tokenizer` / `.corpus`, as the LM datamodule has them). On global rank zero only: its scalars are logged as
`val/<metric>` through `pl_module.log` (so they reach every logger and `trainer.callback_metrics`); with a
WandbLogger attached, its table goes to W&B as `val/<name>` and its plot as `val/<name>/plot`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from torch import nn

from models.config_errors import ConfigError


@dataclass
class EvaluatorReport:
    """What one evaluation gives: scalar metrics (slash names, no `val/`), a table, and a plot (or None)."""

    metrics: dict[str, float]
    columns: list[str]
    rows: list[list]
    image: Path | None = None


class EvaluatorCallback(Callback):
    """Base class: subclasses set `name` and implement `evaluate`. Runs after every `every_n_val`-th validation
    (sanity check excluded); files go to `<out_dir>/step<global step>/`, out_dir defaulting to
    `<trainer.default_root_dir>/<name>`."""

    name: str

    def __init__(self, every_n_val: int = 1, out_dir: str | None = None):
        if every_n_val < 1:
            raise ConfigError(f"every_n_val must be >= 1, got {every_n_val}")
        self.every_n_val, self.out_dir = every_n_val, out_dir
        self.n_val = 0

    def evaluate(self, model: nn.Module, tokenizer, corpus, out_dir: Path) -> EvaluatorReport:
        raise NotImplementedError

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.n_val += 1
        if self.n_val % self.every_n_val or not trainer.is_global_zero:
            return
        datamodule = trainer.datamodule
        if getattr(datamodule, "tokenizer", None) is None or getattr(datamodule, "corpus", None) is None:
            raise ConfigError(
                f"{type(self).__name__} needs a datamodule with `tokenizer` and `corpus` (the LM task, task=lm); "
                f"got {type(datamodule).__name__}. Remove the callback for this task."
            )
        step = trainer.global_step
        out_dir = Path(self.out_dir or Path(trainer.default_root_dir) / self.name) / f"step{step}"
        model, was_training = pl_module.model, pl_module.model.training
        model.eval()
        try:
            report = self.evaluate(model, datamodule.tokenizer, datamodule.corpus, out_dir)
        finally:
            model.train(was_training)
        for key, value in report.metrics.items():
            pl_module.log(f"val/{key}", float(value), rank_zero_only=True)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(f"val/{self.name}", columns=report.columns, data=report.rows, step=step)
                if report.image is not None:
                    logger.log_image(f"val/{self.name}/plot", images=[str(report.image)], step=step)
