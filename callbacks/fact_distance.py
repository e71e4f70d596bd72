"""BABILong accuracy by how far the answer's facts lie behind the question: `evaluate.py eval=[fact_distance]`.

A memory model (RMT, RMT-R, ARMT) reads the question's own segment directly; every other fact reaches the question
only through memory. A test sample's distance d is the number of memory transitions its earliest supporting fact
(bAbI's `supporting`) has to survive: 0 when it ends in the question's segment, d when it ends d segments before.
Accuracy by d, with the memory carried and reset every segment, separates the two ways a long sample is lost:
misreading a segment (d = 0 is already low) and forgetting (accuracy falls with d while the reset stays at chance).
The same samples are also grouped by how many story facts come after the last supporting one (0: the answer's fact
is the story's last, where "answer from the latest fact" is right too): a memory that keeps only what was written
last is right at 0 and at chance after it, however few segments back the fact lies.
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


def supporting_distances(dataset, model: nn.Module) -> list[tuple[int, int]]:
    """(d, facts after) of every sample of a generated BABILong test set (a `HaystackSet`): d as above, and the
    number of story facts after its last supporting fact."""
    out = []
    for i in range(len(dataset)):
        ends, n_segments = fact_segments_of(dataset, i, model)  # 1-based segment of each fact
        supporting = dataset.tasks.supporting[dataset.indices[i]]
        out.append((n_segments - ends[min(supporting)], len(ends) - 1 - max(supporting)))
    return out


def test_batches(
    tokenizer,
    corpus,
    task: str,
    length: int,
    n: int,
    batch_size: int,
    seed: int,
    answer_prompt: str,
    device,
    name: str,
):
    """The BABILong evaluator's first `n` test samples of `task` at `length` tokens (same seed): the `HaystackSet`,
    and its batches on `device` in order, with a progress line `name`."""
    from data.babilong import batch_to, length_name
    from data.curriculum import BabilongDataModule

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
    loader = track(data.eval_loader(dataset, length=length), f"{name} {task} @ {length_name(length)}")
    return dataset, (batch_to(batch, device) for batch in loader)


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
    """Exact match of `n` test samples (the BABILong evaluator's, same seed) per length, by distance bucket and by
    facts-after bucket, with the memory carried and reset. Writes fact_distance.json and fact_distance.png; returns
    `fact_distance/<task>/acc@<length>/d<bucket>` (memory carried), `.../reset/d<bucket>`, and the same with
    `f<bucket>` for facts after."""
    from data.babilong import length_name

    if not hasattr(model, "segment_bounds"):
        raise ConfigError(
            f"eval=[fact_distance] measures what a memory model's memory carries; {type(model).__name__} has no "
            "segments. Use an RMT, RMT-R or ARMT checkpoint."
        )
    task = task or "qa1"
    device = next(model.parameters()).device
    # grouping ("d": segments back, "f": facts after) -> length -> bucket -> {"carried": hits, "reset": hits}
    table: dict[str, dict[str, dict]] = {"d": {}, "f": {}}
    for length in lengths:
        dataset, batches = test_batches(
            tokenizer, corpus, task, length, n, batch_size, seed, answer_prompt, device, "fact distance"
        )
        buckets = iter(
            [(distance_bucket(d), distance_bucket(f)) for d, f in supporting_distances(dataset, model)]
        )
        for batch in batches:
            hits = {}
            for memory in ("carried", "reset"):
                out = model(batch, recurrent=memory == "carried")
                hits[memory] = exact_match(out.logits, out.targets, batch)
            for row in range(len(batch["input_ids"])):
                for grouping, bucket in zip("df", next(buckets), strict=True):
                    cells = table[grouping].setdefault(length_name(length), {})
                    cell = cells.setdefault(str(bucket), {"carried": [], "reset": []})
                    for m, h in hits.items():
                        cell[m].append(float(h[row]))
    summary = {
        grouping: {
            size: {
                b: {m: [float(np.mean(v)), len(v)] for m, v in cell.items()}
                for b, cell in sorted(row.items(), key=lambda kv: int(kv[0]))
            }
            for size, row in by_length.items()
        }
        for grouping, by_length in table.items()
    }
    (Path(out_dir) / "fact_distance.json").write_text(
        json.dumps(
            {"task": task, "seed": seed, "accuracy": summary["d"], "accuracy_by_facts_after": summary["f"]},
            indent=1,
        )
    )
    plot_fact_distance(summary, Path(out_dir) / "fact_distance.png", task)
    metrics = {}
    for grouping, by_length in summary.items():
        for size, row in by_length.items():
            for b, cell in row.items():
                metrics[f"fact_distance/{task}/acc@{size}/{grouping}{b}"] = cell["carried"][0]
                metrics[f"fact_distance/{task}/acc@{size}/reset/{grouping}{b}"] = cell["reset"][0]
    return metrics


XLABELS = {
    "d": "segments between the earliest supporting fact and the question",
    "f": "story facts after the last supporting fact",
}


def plot_fact_distance(summary: dict, path: Path, task: str, min_samples: int = 10) -> None:
    """Accuracy against distance (log2 axis), segments back (left) and facts after (right), a colour per length:
    memory carried solid, reset dashed. Buckets of fewer than `min_samples` samples stay out of the plot (not out of
    the JSON)."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (grouping, by_length) in zip(fig.subplots(1, 2, sharey=True), summary.items(), strict=True):
        for color, (size, row) in zip(
            colormaps["viridis"](np.linspace(0, 0.85, len(by_length))), by_length.items(), strict=True
        ):
            x = [int(b) for b, cell in row.items() if cell["carried"][1] >= min_samples]
            xs = [0.5 if b == 0 else b for b in x]  # 0 drawn left of 1 on the log axis
            carried, reset = ([row[str(b)][m][0] for b in x] for m in ("carried", "reset"))
            ax.plot(xs, carried, "o-", color=color, label=f"{size}: memory carried")
            ax.plot(xs, reset, "x--", color=color, alpha=0.6, label=f"{size}: reset")
        ax.set_xscale("log", base=2)
        ticks = sorted({b for line in ax.get_lines() for b in line.get_xdata()})
        ticks = [0 if b == 0.5 else int(b) for b in ticks]
        ax.set_xticks(
            [0.5 if b == 0 else b for b in ticks], [str(b) if b < 2 else f"{b}-{2 * b - 1}" for b in ticks]
        )
        ax.set(xlabel=XLABELS[grouping], ylabel="exact match", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"BABILong {task}: accuracy by how far back the answer's facts are (buckets of >= {min_samples})"
    )
    fig.savefig(path, dpi=120)
