"""Evaluated checkpoints side by side (`python evaluate.py compare=[A.ckpt,B.ckpt,...]`): their forgetting curves
and perplexity by position on one figure, their fine/coarse memory lengths, and whether PPL or LongPPL tracks their
long-context ability (Fang et al. 2024, Fig. 1b, at the scale of the models compared); and their BABILong accuracy
as one tasks x lengths table and heat map (Kuratov et al. 2024, Fig. 3), memory-reset columns beside it.

Long-context score of a model: its copy gain, copy accuracy minus LM accuracy of its forgetting curve (what having
seen the text adds to next-token accuracy), averaged over the tested lengths, or at one tested length
(`score_length`). Correlations are Pearson's r and Spearman's rho over the models, of the score against PPL and
against LongPPL (lower perplexity should mean a higher score: a useful metric has a strongly negative r).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from callbacks.babilong_eval import plot_accuracy_heatmap, size_key, size_label
from callbacks.forgetting_curve import ForgettingCurveResult
from callbacks.ppl_by_position import PplByPositionResult
from models.config_errors import ConfigError


@dataclass
class EvaluatedModel:
    """What the evaluators wrote for one checkpoint (`<ckpt>.eval/`); None where that evaluator did not run."""

    label: str
    step: int
    ppl: float | None = None
    longppl: float | None = None
    n_key: int | None = None
    n_tokens: int | None = None
    forgetting: ForgettingCurveResult | None = None
    by_position: PplByPositionResult | None = None
    babilong: dict[str, dict[str, dict[str, float]]] = field(
        default_factory=dict
    )  # variant -> {task: {size: acc}}

    @classmethod
    def load(cls, results: str | Path, label: str, step: int | None = None) -> EvaluatedModel:
        """The evaluators' files under `results`; step None: the one evaluate.py wrote in its metrics.json (else 0)."""
        results = Path(results)
        if step is None:
            saved = results / "metrics.json"
            step = (json.loads(saved.read_text()).get("global_step") or 0) if saved.exists() else 0
        model = cls(label, step)
        if (f := results / "ppl" / "ppl.json").exists():
            model.ppl = json.loads(f.read_text())["ppl"]
        if (f := results / "longppl" / "longppl.json").exists():
            data = json.loads(f.read_text())
            model.longppl = data["longppl"]
            model.n_key, model.n_tokens = int(data["longppl/n_key"]), int(data["longppl/n_tokens"])
        if (f := results / "forgetting_curve" / "forgetting_curve.json").exists():
            model.forgetting = ForgettingCurveResult.load_json(f)
        if (f := results / "ppl_by_position" / "ppl_by_position.json").exists():
            model.by_position = PplByPositionResult.load_json(f)
        # babilong[_reset|_latest][_early_facts]
        for f in sorted((results / "babilong").glob("babilong*.json")):
            model.babilong[f.stem] = json.loads(f.read_text())["accuracy"]
        return model

    def copy_gain(self, length: int | None = None) -> float | None:
        """Copy minus LM accuracy: the mean over the tested lengths, or at `length` (one of them)."""
        fc = self.forgetting
        if fc is None:
            return None
        gain = np.subtract(fc.copy_acc, fc.lm_acc)
        if length is None:
            return float(gain.mean())
        if length not in fc.lengths:
            raise ConfigError(
                f"compare_score_length={length} is not a tested length of {self.label}: {fc.lengths}"
            )
        return float(gain[fc.lengths.index(length)])

    def row(self, score_length: int | None) -> dict:
        fc = self.forgetting
        per_1k = None if self.n_key is None or not self.n_tokens else 1000 * self.n_key / self.n_tokens
        return {
            "model": self.label,
            "step": self.step,
            "ppl": self.ppl,
            "longppl": self.longppl,
            "key_tokens_per_1k": per_1k,
            "fine_len": None if fc is None else fc.fine_length,
            "coarse_len": None if fc is None else fc.coarse_length,
            "copy_gain": self.copy_gain(score_length),
        }


def correlations(rows: list[dict]) -> dict[str, float]:
    """Pearson r and Spearman rho of copy_gain against ppl and longppl, over the rows that have both (NaN if < 3)."""
    out = {}
    for metric in ("ppl", "longppl"):
        pairs = np.array(
            [
                (r["copy_gain"], r[metric])
                for r in rows
                if r["copy_gain"] is not None and r[metric] is not None
            ]
        )
        for name, fn in (("pearson", _pearson), ("spearman", _spearman)):
            out[f"compare/{name}/{metric}"] = fn(*pairs.T) if len(pairs) >= 3 else math.nan
    return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else math.nan


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rank = lambda v: np.argsort(np.argsort(v, kind="stable"), kind="stable").astype(float)  # noqa: E731
    return _pearson(rank(x), rank(y))


def markdown_table(rows: list[dict], accuracy: str = "{}") -> str:
    """The rows as a Markdown table (the README's), numbers rounded for reading; other floats in `accuracy`'s format."""
    fmt = {"ppl": "{:.1f}", "longppl": "{:.1f}", "key_tokens_per_1k": "{:.1f}", "copy_gain": "{:+.3f}"}
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    for r in rows:
        cells = [
            "–" if v is None else fmt.get(k, accuracy if isinstance(v, float) else "{}").format(v)
            for k, v in r.items()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


VARIANTS = {  # babilong evaluator files -> column prefix
    "babilong": "",
    "babilong_reset": "reset ",
    "babilong_early_facts": "early ",
    "babilong_reset_early_facts": "early reset ",
    "babilong_latest": "latest ",  # RMT-R retrieving from its latest state alone
    "babilong_latest_early_facts": "early latest ",
}


def babilong_rows(models: list[EvaluatedModel]) -> list[dict]:
    """One row per model and task: accuracy by length with memory carried, then the ablations' columns ("reset 1k":
    memory reset every segment, "early 1k": facts before the last segment, "latest 1k": RMT-R retrieving from its
    latest state alone); None where a cell was not evaluated."""
    cells: dict[tuple[str, str], dict[str, float]] = {}
    columns: dict[str, tuple] = {}
    for m in models:
        for variant, table in m.babilong.items():
            prefix = VARIANTS[variant]
            for task, row in table.items():
                for size, acc in row.items():
                    name = prefix + size_label(size)
                    cells.setdefault((m.label, task), {})[name] = acc
                    columns[name] = (list(VARIANTS.values()).index(prefix), size_key(size))
    order = sorted(columns, key=columns.get)
    keys = sorted(
        cells, key=lambda key: _task_number(key[1])
    )  # stable: models keep their order within a task
    return [
        {"model": label, "task": task} | {c: cells[label, task].get(c) for c in order} for label, task in keys
    ]


def _task_number(task: str) -> int:
    return int(task[2:]) if task[2:].isdigit() else 10**9


def write_babilong(models: list[EvaluatedModel], out: Path) -> None:
    """babilong.{md,png}: the tasks x lengths table of every model, and the heat map of its memory-carried cells."""
    rows = babilong_rows(models)
    (out / "babilong.md").write_text(markdown_table(rows, accuracy="{:.2f}"))
    heat = {
        f"{task} {m.label}": m.babilong["babilong"][task]
        for task in dict.fromkeys(r["task"] for r in rows)
        for m in models
        if task in m.babilong.get("babilong", {})
    }
    if heat:
        plot_accuracy_heatmap(heat, out / "babilong.png", title="BABILong accuracy, memory carried")


def plot_comparison(models: list[EvaluatedModel], rows: list[dict], path: str | Path | None = None) -> Figure:
    """Up to three panels, each where some model has the data: forgetting curves (copy solid, LM dashed), perplexity
    by position, and PPL / LongPPL against the copy gain (from 3 models with both, where a correlation exists)."""
    panels = [
        p
        for p, has in (
            ("forgetting", any(m.forgetting for m in models)),
            ("position", any(m.by_position for m in models)),
            ("scatter", sum(r["copy_gain"] is not None and r["ppl"] is not None for r in rows) >= 3),
        )
        if has
    ]
    if not panels:
        raise ConfigError(
            "Nothing to compare: the checkpoints have no forgetting_curve, ppl_by_position or babilong results."
        )
    fig = Figure(figsize=(5.5 * len(panels), 4.5))
    FigureCanvasAgg(fig)
    colors = {m.label: f"C{i % 10}" for i, m in enumerate(models)}
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        if panel == "forgetting":
            for m in (m for m in models if m.forgetting):
                fc = m.forgetting
                ax.plot(fc.lengths, fc.copy_acc, "-o", ms=3, color=colors[m.label], label=f"{m.label} copy")
                ax.plot(fc.lengths, fc.lm_acc, "--", color=colors[m.label], alpha=0.7, label=f"{m.label} LM")
            top = max(max(m.forgetting.copy_acc + m.forgetting.lm_acc) for m in models if m.forgetting)
            ax.set(xlabel="prefix length l (tokens)", ylabel="next-token accuracy")
            ax.set_ylim(0, 1.02 if top > 0.5 else None)  # small accuracies get the room to show their gap
            ax.set_title("Forgetting curves (copy solid, LM dashed)")
        elif panel == "position":
            for m in (m for m in models if m.by_position):
                bp = m.by_position
                x = np.sqrt(np.multiply(bp.edges[:-1], bp.edges[1:]))  # geometric bin centres
                ax.plot(x, bp.ppl, "-o", ms=3, color=colors[m.label], label=m.label)
            ax.set(xscale="log", yscale="log", xlabel="token position", ylabel="perplexity")
            ax.set_title("Perplexity by position")
        else:
            corr = correlations(rows)
            for metric, marker in (("ppl", "o"), ("longppl", "s")):
                pts = [r for r in rows if r["copy_gain"] is not None and r[metric] is not None]
                if not pts:
                    continue
                r_val = corr[f"compare/pearson/{metric}"]
                ax.scatter(
                    [p["copy_gain"] for p in pts],
                    [p[metric] for p in pts],
                    marker=marker,
                    c=[colors[p["model"]] for p in pts],
                    label=f"{'PPL' if metric == 'ppl' else 'LongPPL'} (r = {r_val:+.2f})",
                )
            ax.set(yscale="log", xlabel="copy gain (copy − LM accuracy)", ylabel="perplexity")
            ax.set_title("PPL and LongPPL against long-context ability")
        ax.grid(alpha=0.3)
        legend = ax.legend(fontsize=7, ncol=2 if panel == "forgetting" else 1)
        if panel == "scatter":
            for handle in legend.legend_handles:  # the marker shape names the metric; colours name models
                handle.set_facecolor("0.5")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def compare(
    models: list[EvaluatedModel], out_dir: str | Path, score_length: int | None = None
) -> dict[str, float]:
    """comparison.{json,csv,md,png} into out_dir, and babilong.{md,png} where models have BABILong results; returns
    the correlations (none when the models have BABILong results only)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(m.babilong for m in models):
        write_babilong(models, out)
        if not any(m.ppl or m.longppl or m.forgetting or m.by_position for m in models):
            return {}
    rows = [m.row(score_length) for m in models]
    corr = correlations(rows)
    clean = {k: None if math.isnan(v) else v for k, v in corr.items()}
    (out / "comparison.json").write_text(
        json.dumps({"score_length": score_length, **clean, "models": rows}, indent=2)
    )
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "comparison.md").write_text(markdown_table(rows))
    if any(m.babilong for m in models) and not any(m.forgetting or m.by_position for m in models):
        return corr  # nothing to plot beside the heat map
    plot_comparison(models, rows, out / "comparison.png")
    return corr
