"""BABILong evaluation: exact-match accuracy as a torchmetrics metric, and the task x length heat map of the
paper's figures (Kuratov et al. 2024, Fig. 3-5, 9), drawn after `trainer.test` from the logged
`test/<task>/acc@<length>` metrics (or `val/...`), saved to the run folder and logged to W&B when it is the logger.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torchmetrics
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from models.lit_module import exact_match

METRIC = re.compile(r"^(?P<split>val|test)/(?P<task>qa\d+)/acc@(?P<size>[^/]+)$")


class ExactMatch(torchmetrics.MeanMetric):
    """Share of samples whose answer (all its tokens and EOS) is predicted exactly. update(logits (N, V) at the
    scored positions, targets (N,), batch with labels and answer_mask (B, T))."""

    def update(self, logits: Tensor, targets: Tensor, batch: dict) -> None:
        super().update(exact_match(logits, targets, batch))


def size_key(name: str) -> tuple[int, float]:
    """Column order: lengths ("0k" < "1k" < ... < "1M", plain numbers too), then segment counts ("4seg")."""
    m = re.fullmatch(r"(\d+)(k|M|seg)?", name)
    if m is None:
        return (2, 0.0)
    scale = {None: 1, "k": 2**10, "M": 2**20, "seg": 1}[m.group(2)]
    return (int(m.group(2) == "seg"), float(m.group(1)) * scale)


def size_label(size: str) -> str:
    """Column label of a size: "facts only" for 0 ("0k", "0", "0seg"), else the size itself."""
    return "facts only" if re.fullmatch(r"0(k|seg)?", size) else size


def plot_accuracy_heatmap(
    table: dict[str, dict[str, float]], path: str | Path | None = None, title: str = ""
) -> Figure:
    """Heat map of accuracy (in [0, 1], shown in %) with tasks as rows and sizes as columns: `table[task][size]`,
    e.g. {"qa1": {"0k": 1.0, "1k": 0.98}}. Missing cells stay blank. A minimum size and constrained layout keep
    title, labels and colour bar inside the figure at any grid size. Agg canvas; saved if `path` is given."""
    if not table:
        raise ValueError("Empty accuracy table: evaluate at least one task and length first.")
    tasks = sorted(table, key=lambda t: int(t[2:]) if t[2:].isdigit() else 10**9)
    sizes = sorted({s for row in table.values() for s in row}, key=size_key)
    acc = np.full((len(tasks), len(sizes)), np.nan)
    for i, t in enumerate(tasks):
        for j, s in enumerate(sizes):
            acc[i, j] = table[t].get(s, np.nan)
    width, height = max(5.0, 2.2 + 0.8 * len(sizes)), max(3.0, 1.6 + 0.45 * len(tasks))
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(100 * acc, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i, j in zip(*np.nonzero(~np.isnan(acc)), strict=True):
        ax.text(j, i, f"{100 * acc[i, j]:.0f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(sizes)), [size_label(s) for s in sizes])
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_xlabel("context length" if all(size_key(s)[0] == 0 for s in sizes) else "sample size")
    if title:
        ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy, %")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def accuracy_table(metrics: dict, split: str = "test") -> dict[str, dict[str, float]]:
    """{task: {size: accuracy}} from logged metrics named `<split>/<task>/acc@<size>`."""
    table: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        m = METRIC.match(key)
        if m and m["split"] == split:
            table.setdefault(m["task"], {})[m["size"]] = float(value)
    return table


class BabilongHeatmap(Callback):
    """After `trainer.test`, draws the task x length accuracy heat map to `<run dir>/babilong_<split>.png`."""

    def __init__(self, split: str = "test"):
        self.split = split

    def on_test_end(self, trainer, pl_module) -> None:
        table = accuracy_table(trainer.callback_metrics, self.split)
        if not table or not trainer.is_global_zero:
            return
        path = Path(trainer.default_root_dir) / f"babilong_{self.split}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_accuracy_heatmap(table, path, title=f"BABILong {self.split} accuracy")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(f"{self.split}/babilong_heatmap", [str(path)], step=trainer.global_step)
