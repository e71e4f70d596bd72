"""Progress of a training run: a rich bar on a terminal, plain log lines anywhere else.

`track` does the same for any long loop (evaluators): rich's bar on a terminal, else a line with count, rate, elapsed
time and ETA every `every_s` seconds and at the end.

`StepProgressBar` is Lightning's rich bar counted in optimizer steps out of `trainer.max_steps` (training streams
are infinite: no epochs, so no "Epoch 0/-2", and a resumed run's bar starts at its step, not at "60/10").
`ProgressLog` writes when no bar is shown (`build_callbacks` shows none when stdout is not a terminal: `nohup`,
a cluster job, `> log.txt`): a line every `every_n_steps` optimizer steps or `every_s` seconds, whichever comes
first (step, loss, tokens/s, elapsed, ETA, curriculum stage), and one per validation with its metrics.
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from collections.abc import Iterable, Iterator

import lightning as L
import rich.progress
from lightning.pytorch.callbacks import RichProgressBar

log = logging.getLogger(__name__)


class StepProgressBar(RichProgressBar):
    """RichProgressBar over optimizer steps: `global_step / max_steps`."""

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        return max_steps if max_steps and max_steps > 0 else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'Training':{len(self.validation_description)}}"

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._update(self.train_progress_bar_id, trainer.global_step)

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class ProgressLog(L.Callback):
    """Plain progress lines for output that is not a terminal (active only when the trainer shows no bar)."""

    def __init__(self, every_n_steps: int = 50, every_s: float = 60.0):
        self.every_n_steps, self.every_s = every_n_steps, every_s
        self.active = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.active = trainer.progress_bar_callback is None and trainer.is_global_zero
        self.t0 = self.last_t = time.monotonic()
        self.step0 = self.last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, now = trainer.global_step, time.monotonic()
        due = step - self.last_step >= self.every_n_steps or now - self.last_t >= self.every_s
        if self.active and step > self.last_step and (due or step == trainer.max_steps):
            self.last_step, self.last_t = step, now
            log.info(progress_line(trainer, step, now - self.t0, step - self.step0))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.active or trainer.sanity_checking:
            return
        log.info(
            "validation at step %d: %s", trainer.global_step, metrics_line(trainer.callback_metrics, "val/")
        )


def metrics_line(metrics: dict, prefix: str) -> str:
    """`val/loss 3.2, val/ppl 24.5`: the metrics named `prefix...`, sorted, one line (or "no metrics")."""
    listed = ", ".join(f"{k} {float(v):.4g}" for k, v in sorted(metrics.items()) if k.startswith(prefix))
    return listed or "no metrics"


def progress_line(trainer: L.Trainer, step: int, elapsed: float, done: int) -> str:
    """`step 100/300 (33%) | loss 6.41 | 14,210 tok/s | 0:01:05 elapsed, ETA 0:02:10 | curriculum stage 1: 2 seg`;
    `done` steps took `elapsed` seconds (validations included)."""
    metrics, total = trainer.callback_metrics, trainer.max_steps
    parts = [f"step {step}/{total} ({step / total:.0%})" if total and total > 0 else f"step {step}"]
    if "train/loss" in metrics:
        parts.append(f"loss {float(metrics['train/loss']):.4g}")
    if "train/tokens_per_s" in metrics:
        parts.append(f"{float(metrics['train/tokens_per_s']):,.0f} tok/s")
    timing = f"{clock(elapsed)} elapsed"
    if total and total > 0 and done:
        timing += f", ETA {clock(elapsed / done * (total - step))}"
    parts.append(timing)
    data = trainer.datamodule
    if hasattr(data, "max_segments"):
        size = f"{data.max_segments} segments" if data.max_segments else "facts only"
        parts.append(f"curriculum stage {data.stage}: {size}")
    return " | ".join(parts)


def clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def track(
    items: Iterable, description: str, total: int | None = None, every_s: float = 30.0, disable: bool = False
) -> Iterator:
    """Iterate `items` showing progress: rich's bar on a terminal; otherwise (a log file, `nohup`) a line
    `description: 3/8 (38%) | 0.52 it/s | 0:00:06 elapsed, ETA 0:00:10` every `every_s` seconds and at the end."""
    if disable:
        yield from items
        return
    if sys.stdout.isatty():
        yield from rich.progress.track(items, description, total=total)
        return
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    t0 = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= every_s or done == total:
            last = now
            log.info(track_line(description, done, total, now - t0))


def track_line(description: str, done: int, total: int | None, elapsed: float) -> str:
    count = f"{done}/{total} ({done / total:.0%})" if total else str(done)
    timing = f"{clock(elapsed)} elapsed" + (
        f", ETA {clock(elapsed / done * (total - done))}" if total else ""
    )
    return f"{description}: {count} | {done / max(elapsed, 1e-9):.3g} it/s | {timing}"
