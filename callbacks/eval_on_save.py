"""Run the evaluators of configs/eval/ on every checkpoint a training run saves, in the training process.

Lightning runs checkpoint callbacks last, so a save is seen at the next hook (the next batch start, or the end of
fit): the weights are then still those saved. The shared `Watcher` of `callbacks/watch.py` finds the new files,
evaluates each global step once (`last.ckpt` and `stepN.ckpt` saved together count once), writes
`<ckpt>.eval/` and its done marker (a later `evaluate.py watch=RUN_DIR` skips this work), and the metrics go to
the trainer's loggers as `eval/<metric>` at the checkpoint's global step. Only global rank zero evaluates.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf

from callbacks.checkpoint import model_weights
from callbacks.watch import Watcher, results_dir
from evaluate import checkpoint_task, evaluate_model, log_results, write_results
from models.config_errors import ConfigError


class EvalOnSave(L.Callback):
    """evaluators: `{name: {_target_: fn, **flat_args}}` (the `eval` config group)."""

    def __init__(self, evaluators: Mapping):
        if isinstance(evaluators, DictConfig):
            evaluators = OmegaConf.to_container(evaluators, resolve=True)
        if not evaluators:
            raise ConfigError("callbacks=eval_on_save needs evaluators: eval=[ppl,...] (configs/eval/*.yaml)")
        self.evaluators = dict(evaluators)
        self._saved = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._saved = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._evaluate_saved(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._evaluate_saved(trainer, pl_module)

    def _evaluate_saved(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ckpt = trainer.checkpoint_callback
        if not self._saved or ckpt is None or not ckpt.dirpath:
            return
        self._saved = False
        if trainer.is_global_zero:

            def evaluate_fn(path: Path, checkpoint: dict) -> dict[str, float]:
                return self._evaluate(trainer, pl_module, path, checkpoint)

            Watcher(ckpt.dirpath, evaluate_fn, settle_s=0.0, tag=sorted(self.evaluators)).scan()
        trainer.strategy.barrier("eval_on_save")

    def _evaluate(self, trainer, pl_module, path: Path, checkpoint: dict) -> dict[str, float]:
        model, step = pl_module.model, int(checkpoint["global_step"])
        if step != trainer.global_step:  # a file from before this fit (e.g. the one resumed from)
            model = copy.deepcopy(model)
            model.load_state_dict(model_weights(checkpoint, path))
        data = trainer.datamodule
        metrics, images = evaluate_model(
            model,
            data.tokenizer,
            data.corpus,
            checkpoint_task(self.evaluators, checkpoint.get("config") or {}),
            results_dir(path),
            trainer.precision_plugin.forward_context,
        )
        write_results(results_dir(path), str(path), step, metrics)
        log_results(trainer.loggers, metrics, images, step)
        return metrics
