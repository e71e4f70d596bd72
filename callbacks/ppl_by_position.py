"""Perplexity as a function of token position (Liu et al. 2024, "Forgetting Curve", Figure 5 bottom; Dai et al.
2019): long held-out documents are streamed through a task model and each token's NLL is binned by its position.

Token j of a document (j >= 1) is predicted from the j tokens before it; bin i holds positions
[edges[i], edges[i+1]), and its perplexity is exp(mean NLL) over all its tokens in all documents (token-weighted,
like corpus perplexity). Documents are cut to edges[-1] tokens.

Any task model with `iter_logits(input_ids (B, T)) -> chunks (B, T_i, V)` works (sliding-window CausalLM,
Llama-XL, RMT): chunks are scored as they come, so memory stays that of one chunk and 64k-token documents run.
Documents of equal (cut) length are batched together, `batch_size` rows at a time.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from models.config_errors import ConfigError

BIN_KINDS = ("linear", "log")
TokenDocs = Sequence[np.ndarray | torch.Tensor]


def position_bins(max_len: int, n_bins: int = 16, kind: str = "log", min_pos: int = 1) -> list[int]:
    """Bin edges min_pos = e_0 < ... < e_k = max_len, evenly ("linear") or geometrically ("log") spaced.
    Rounding can merge neighbours, so fewer than n_bins bins may come back."""
    if kind not in BIN_KINDS:
        raise ConfigError(f"Unknown bin kind {kind!r}; choose one of {BIN_KINDS}.")
    if not 1 <= min_pos < max_len or n_bins < 1:
        raise ConfigError(f"need 1 <= min_pos < max_len and n_bins >= 1, got {min_pos}, {max_len}, {n_bins}.")
    space = np.linspace if kind == "linear" else np.geomspace
    return sorted({round(float(e)) for e in space(min_pos, max_len, n_bins + 1)})


@dataclass
class PplByPositionResult:
    """Per bin [edges[i], edges[i+1]): summed NLL (nats), token count and perplexity (NaN for an empty bin)."""

    edges: list[int]
    nll_sum: list[float]
    n_tokens: list[int]
    n_docs: int
    ppl: list[float] = field(init=False)

    def __post_init__(self):
        if not len(self.nll_sum) == len(self.n_tokens) == len(self.edges) - 1:
            raise ValueError("nll_sum and n_tokens need one entry per bin (len(edges) - 1)")
        self.ppl = [
            math.exp(s / n) if n else math.nan for s, n in zip(self.nll_sum, self.n_tokens, strict=True)
        ]

    @property
    def overall_ppl(self) -> float:
        """Perplexity over every binned token."""
        n = sum(self.n_tokens)
        return math.exp(sum(self.nll_sum) / n) if n else math.nan

    def rows(self) -> list[dict]:
        """One dict per bin: start, end (exclusive), ppl, n_tokens."""
        return [
            {"start": lo, "end": hi, "ppl": p, "n_tokens": n}
            for lo, hi, p, n in zip(self.edges[:-1], self.edges[1:], self.ppl, self.n_tokens, strict=True)
        ]

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["start", "end", "ppl", "n_tokens"])
            writer.writeheader()
            writer.writerows(self.rows())

    def save_json(self, path: str | Path) -> None:
        data = dataclasses.asdict(self)
        data["ppl"] = [None if math.isnan(p) else p for p in self.ppl]  # strict JSON has no NaN
        Path(path).write_text(json.dumps(data, indent=2))

    @classmethod
    def load_json(cls, path: str | Path) -> PplByPositionResult:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.init})


def _as_long(doc: np.ndarray | torch.Tensor) -> torch.Tensor:
    t = doc if isinstance(doc, torch.Tensor) else torch.from_numpy(np.asarray(doc).astype(np.int64))
    if t.dim() != 1:
        raise ValueError(f"Each document must be a 1-D token array, got shape {tuple(t.shape)}.")
    return t.long()


def _batches(docs: TokenDocs, max_len: int, min_len: int, batch_size: int) -> list[list[torch.Tensor]]:
    """Documents cut to max_len, grouped by length into batches of up to batch_size (shorter than min_len: none)."""
    by_len: dict[int, list[torch.Tensor]] = {}
    for doc in docs:
        t = _as_long(doc)[:max_len]
        if len(t) >= min_len:
            by_len.setdefault(len(t), []).append(t)
    return [
        group[i : i + batch_size]
        for _, group in sorted(by_len.items())
        for i in range(0, len(group), batch_size)
    ]


@torch.no_grad()
def ppl_by_position(
    model: nn.Module, docs: TokenDocs, bins: Sequence[int], batch_size: int = 1, progress: bool = False
) -> PplByPositionResult:
    """Perplexity per position bin of `model` (a task model with `iter_logits`) over `docs` (1-D token arrays).

    bins: increasing edges (see `position_bins`); run in eval mode, the model's mode restored afterwards.
    """
    edges = [int(e) for e in bins]
    if len(edges) < 2 or edges[0] < 1 or np.any(np.diff(edges) <= 0):
        raise ConfigError(f"bins must be >= 2 strictly increasing edges starting at >= 1, got {edges}.")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    edge_t = torch.tensor(edges, device=device)
    nll_sum = torch.zeros(len(edges) - 1, dtype=torch.float64, device=device)
    counts = torch.zeros(len(edges) - 1, dtype=torch.long, device=device)
    batches = _batches(docs, edges[-1], edges[0] + 1, batch_size)
    was_training = model.training
    model.eval()
    columns = (TextColumn("ppl by position"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("", total=sum(len(b) * len(b[0]) for b in batches))
            for group in batches:
                ids = torch.stack(group).to(device)  # (B, L)
                B, L = ids.shape
                done = 0
                for logits in model.iter_logits(ids):  # (B, T_i, V) predicting ids[:, done+1 : done+T_i+1]
                    if logits.dim() != 3 or logits.shape[0] != B or done + logits.shape[1] > L:
                        raise ValueError(
                            f"iter_logits must yield (B={B}, T_i, V) chunks covering the {L} input positions in "
                            f"order; got {tuple(logits.shape)} after {done} positions."
                        )
                    pos = torch.arange(
                        done + 1, done + logits.shape[1] + 1, device=device
                    )  # predicted tokens
                    keep = (pos < L) & (pos >= edges[0])
                    pos, chunk = pos[keep], logits[:, keep].float()
                    nll = chunk.logsumexp(-1) - chunk.gather(-1, ids[:, pos, None])[..., 0]  # (B, n)
                    bin_idx = torch.bucketize(pos, edge_t, right=True) - 1
                    nll_sum.index_add_(0, bin_idx, nll.double().sum(0))
                    counts.index_add_(0, bin_idx, torch.full_like(bin_idx, B))
                    done += logits.shape[1]
                    bar.advance(task, B * logits.shape[1])
                if done != L:
                    raise ValueError(
                        f"iter_logits covered {done} of {L} positions; its chunks must cover all."
                    )
    finally:
        model.train(was_training)
    return PplByPositionResult(edges, nll_sum.tolist(), counts.tolist(), sum(len(b) for b in batches))


def plot_ppl_by_position(
    result: PplByPositionResult, path: str | Path | None = None, title: str | None = None
) -> Figure:
    """Perplexity per bin as a step curve over token position (log x-axis when the bins grow geometrically).
    Agg canvas, no pyplot state; saved if path is given."""
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    edges = np.asarray(result.edges, dtype=float)
    ax.stairs(result.ppl, edges, color="tab:blue", linewidth=1.8)
    widths = np.diff(edges)
    if len(widths) > 1 and widths[-1] > 4 * widths[0]:
        ax.set_xscale("log")
    ax.set(xlabel="token position (context length)", ylabel="perplexity", xlim=(edges[0], edges[-1]))
    ax.set_title(title or f"Perplexity by position ({result.n_docs} documents)")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def held_out_docs(corpus, tokenizer, split: str) -> TokenDocs:
    """`[bos] document` token arrays of a held-out split of a corpus (tokenization is cached)."""
    from data.corpus import tokenize_corpus

    docs = tokenize_corpus(corpus, tokenizer)[split]
    return [np.concatenate([[tokenizer.bos_id], docs.doc(i).astype(np.int64)]) for i in range(len(docs))]


def evaluate_ppl_by_position(
    model: nn.Module,
    tokenizer,
    corpus,
    out_dir: Path,
    split: str = "test",
    max_len: int = 65536,
    n_bins: int = 16,
    kind: str = "log",
    max_docs: int | None = None,
    min_len: int | None = None,
) -> dict[str, float]:
    """evaluate.py evaluator: perplexity by token position over the held-out documents (JSON, CSV, PNG).
    min_len: only documents of at least that many tokens, so that every bin up to min_len averages the same
    documents (otherwise the late bins hold only the long ones, which may be easier or harder text)."""
    docs = held_out_docs(corpus, tokenizer, split)
    if min_len:
        docs = [d for d in docs if len(d) >= min_len]
        if not docs:
            raise ConfigError(
                f"No {split} document has min_len={min_len} tokens; lower eval.ppl_by_position.min_len."
            )
    docs = docs[:max_docs]
    result = ppl_by_position(model, docs, position_bins(max_len, n_bins, kind), progress=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result.save_json(out_dir / "ppl_by_position.json")
    result.to_csv(out_dir / "ppl_by_position.csv")
    plot_ppl_by_position(result, out_dir / "ppl_by_position.png")
    filled = [p for p in result.ppl if not math.isnan(p)]
    return {
        "ppl_by_position/ppl": result.overall_ppl,
        "ppl_by_position/last_bin": filled[-1] if filled else math.nan,
    }


class PplByPosition(Callback):
    """Every `every_n_val`-th validation (sanity check excluded), on global rank zero: perplexity by position of
    `pl_module.model` over held-out documents, saved as JSON/CSV/PNG under `out_dir` (default
    `<trainer.default_root_dir>/ppl_by_position`) and logged: scalars `val/ppl_by_position/{ppl,first_bin,last_bin}`
    to every logger, plus table `val/ppl_by_position` and image `val/ppl_by_position/plot` to loggers that take them
    (W&B). Documents come from `docs`, or `docs_fn()`, or else the datamodule's held-out `split`, loaded once.
    """

    def __init__(
        self,
        docs: TokenDocs | None = None,
        docs_fn: Callable[[], TokenDocs] | None = None,
        max_len: int = 65536,
        n_bins: int = 16,
        kind: str = "log",
        every_n_val: int = 1,
        batch_size: int = 1,
        out_dir: str | None = None,
        split: str = "validation",
    ):
        if docs is not None and docs_fn is not None:
            raise ValueError(
                "Give at most one of docs (token arrays) or docs_fn (a function returning them)."
            )
        if every_n_val < 1:
            raise ConfigError(f"every_n_val must be >= 1, got {every_n_val}")
        self.docs, self.docs_fn = docs, docs_fn
        self.edges = position_bins(max_len, n_bins, kind)
        self.every_n_val, self.batch_size, self.out_dir = every_n_val, batch_size, out_dir
        self.n_val, self.split = 0, split

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self.n_val += 1
        if self.n_val % self.every_n_val or not trainer.is_global_zero:
            return
        if self.docs is None:
            self.docs = (
                self.docs_fn()
                if self.docs_fn
                else held_out_docs(trainer.datamodule.corpus, trainer.datamodule.tokenizer, self.split)
            )
        result = ppl_by_position(pl_module.model, self.docs, self.edges, self.batch_size)
        step = trainer.global_step
        out = Path(self.out_dir or Path(trainer.default_root_dir) / "ppl_by_position")
        out.mkdir(parents=True, exist_ok=True)
        result.save_json(out / f"step{step}.json")
        result.to_csv(out / f"step{step}.csv")
        png = out / f"step{step}.png"
        plot_ppl_by_position(result, png, title=f"Perplexity by position, step {step}")
        filled = [p for p in result.ppl if not math.isnan(p)]
        scalars = {
            "val/ppl_by_position/ppl": result.overall_ppl,
            "val/ppl_by_position/first_bin": filled[0] if filled else math.nan,
            "val/ppl_by_position/last_bin": filled[-1] if filled else math.nan,
        }
        rows = [list(r.values()) for r in result.rows()]
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)
            if hasattr(logger, "log_table") and hasattr(logger, "log_image"):
                logger.log_table(
                    "val/ppl_by_position", columns=["start", "end", "ppl", "n_tokens"], data=rows, step=step
                )
                logger.log_image("val/ppl_by_position/plot", images=[str(png)], step=step)
