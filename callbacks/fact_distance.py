"""BABILong accuracy by how far the answer's facts lie behind the question: `evaluate.py eval=[fact_distance]`.

A memory model (RMT, RMT-R, ARMT) reads the question's own segment directly; every other fact reaches the question
only through memory. A test sample's distance d is the number of memory transitions its earliest supporting fact
(bAbI's `supporting`) has to survive: 0 when it ends in the question's segment, d when it ends d segments before.
Accuracy by d, with the memory carried and reset every segment, separates the two ways a long sample is lost:
misreading a segment (d = 0 is already low) and forgetting (accuracy falls with d while the reset stays at chance).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import nn

from callbacks.memory_maps import fact_segments_of
from callbacks.progress import track
from models.config_errors import ConfigError
from models.lit_module import exact_match


def distance_bucket(d: int) -> int:
    """0, 1, then powers of two: d goes to the largest of 0, 1, 2, 4, 8, ... that is <= d."""
    return 0 if d == 0 else 1 << (d.bit_length() - 1)


def supporting_distances(dataset, model: nn.Module) -> list[int]:
    """Distance d (above) of every sample of a generated BABILong test set (a `HaystackSet`)."""
    out = []
    for i in range(len(dataset)):
        ends, n_segments = fact_segments_of(dataset, i, model)  # 1-based segment of each fact
        out.append(n_segments - ends[min(dataset.tasks.supporting[dataset.indices[i]])])
    return out


@torch.no_grad()
def fact_distance(
    model: nn.Module,
    tokenizer,
    corpus,
    out_dir: Path,
    task: str | None = None,
    lengths: tuple[int, ...] = (1024, 4096, 16384),
    n: int = 300,
    batch_size: int = 8,
    seed: int = 0,
    answer_prompt: str = "Answer:",
) -> dict[str, float]:
    """Exact match of `n` test samples (the BABILong evaluator's, same seed) per length, by distance bucket, with
    the memory carried and reset. Writes fact_distance.json and fact_distance.png; returns
    `fact_distance/<task>/acc@<length>/d<bucket>` (memory carried) and `.../reset/d<bucket>`."""
    from data.babilong import batch_to, length_name
    from data.curriculum import BabilongDataModule

    if not hasattr(model, "segment_bounds"):
        raise ConfigError(
            f"eval=[fact_distance] measures what a memory model's memory carries; {type(model).__name__} has no "
            "segments. Use an RMT, RMT-R or ARMT checkpoint."
        )
    task = task or "qa1"
    device = next(model.parameters()).device
    table: dict[str, dict] = {}  # length -> bucket -> {"carried": hits, "reset": hits}
    for length in lengths:
        data = BabilongDataModule(
            tokenizer,
            corpus,
            task=task,
            n_test=n,
            test_lengths=[length],
            eval_batch_size=batch_size,
            eval_seed=seed,
            answer_prompt=answer_prompt,
        )
        dataset = data.test_set(length)
        buckets = iter([distance_bucket(d) for d in supporting_distances(dataset, model)])
        cells = table.setdefault(length_name(length), {})
        for batch in track(
            data.eval_loader(dataset, length=length), f"fact distance {task} @ {length_name(length)}"
        ):
            batch = batch_to(batch, device)
            hits = {}
            for memory in ("carried", "reset"):
                out = model(batch, recurrent=memory == "carried")
                hits[memory] = exact_match(out.logits, out.targets, batch)
            for row in range(len(batch["input_ids"])):
                cell = cells.setdefault(str(next(buckets)), {"carried": [], "reset": []})
                for m, h in hits.items():
                    cell[m].append(float(h[row]))
    summary = {
        size: {
            b: {m: [float(np.mean(v)), len(v)] for m, v in cell.items()}
            for b, cell in sorted(row.items(), key=lambda kv: int(kv[0]))
        }
        for size, row in table.items()
    }
    (Path(out_dir) / "fact_distance.json").write_text(
        json.dumps({"task": task, "seed": seed, "accuracy": summary}, indent=1)
    )
    plot_fact_distance(summary, Path(out_dir) / "fact_distance.png", task)
    metrics = {}
    for size, row in summary.items():
        for b, cell in row.items():
            metrics[f"fact_distance/{task}/acc@{size}/d{b}"] = cell["carried"][0]
            metrics[f"fact_distance/{task}/acc@{size}/reset/d{b}"] = cell["reset"][0]
    return metrics


def plot_fact_distance(summary: dict, path: Path, task: str, min_samples: int = 10) -> None:
    """Accuracy against distance (log2 axis), a colour per length: memory carried solid, reset dashed. Buckets of
    fewer than `min_samples` samples stay out of the plot (not out of the JSON)."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for color, (size, row) in zip(
        colormaps["viridis"](np.linspace(0, 0.85, len(summary))), summary.items(), strict=True
    ):
        x = [int(b) for b, cell in row.items() if cell["carried"][1] >= min_samples]
        xs = [0.5 if b == 0 else b for b in x]  # d = 0 drawn left of 1 on the log axis
        ax.plot(
            xs, [row[str(b)]["carried"][0] for b in x], "o-", color=color, label=f"{size}: memory carried"
        )
        ax.plot(
            xs, [row[str(b)]["reset"][0] for b in x], "x--", color=color, alpha=0.6, label=f"{size}: reset"
        )
    ax.set_xscale("log", base=2)
    ticks = sorted({b for line in ax.get_lines() for b in line.get_xdata()})
    ticks = [0 if b == 0.5 else int(b) for b in ticks]
    ax.set_xticks(
        [0.5 if b == 0 else b for b in ticks], [str(b) if b < 2 else f"{b}-{2 * b - 1}" for b in ticks]
    )
    ax.set(
        xlabel="segments between the earliest supporting fact and the question",
        ylabel="exact match",
        ylim=(0, 1.02),
        title=f"BABILong {task}: accuracy by how far back the facts are\n(buckets of at least {min_samples} samples)",
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
