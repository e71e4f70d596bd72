"""Forgetting curve (Liu et al. 2024, "Forgetting Curve: A Reliable Method for Evaluating Memorization Capability
for Long-context Models"): copy accuracy vs language-model accuracy as the prefix grows.

For each test length l and each of n samples, a target S and an irrelevant text I (l tokens each) are drawn at
random from a held-out token stream:
    copy input  [bos] S [bos] S [eos]        LM input  [bos] I [bos] S [eos]        (T = 2l + 3)
I never overlaps S. With `doc_offsets` (document i is tokens[offsets[i]:offsets[i+1]], the layout of
`data.corpus.TokenizedSplit`) I also shares no document with S: it lies wholly before the first or after the last
document that S touches. Without offsets every token counts as its own document, so the rule is just "no overlap".
S is uniform over the starts that leave room for such an I, then I is uniform over its allowed starts; each
length draws from its own generator seeded by (seed, l), so a length's samples do not depend on the rest of the grid.

One teacher-forced forward per input (all 2n inputs of a length in one `predict` batch). Accuracy is the share of
argmax predictions equal to the next token over the second half of the second S (offsets l//2 .. l-1, i.e. the
last ceil(l/2) tokens; the first half shows the model the copy pattern; the final eos is not scored).
Per length: mean and population std (ddof=0) over samples.
Fine-grained memory length: largest tested length with copy accuracy >= 99%. Coarse-grained memory length: largest
tested length with copy accuracy > LM accuracy + 1 point (0 if none). Longer lengths are the amnesia region.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from torch import nn

from callbacks.evaluator_callback import EvaluatorCallback, EvaluatorReport
from data.corpus import Corpus, tokenize_corpus
from data.tokenizer import Tokenizer
from models.config_errors import ConfigError
from models.streaming import predict_fn

Predictor = Callable[[torch.Tensor], torch.Tensor]  # input_ids (B, T) -> argmax next-token ids (B, T)

FINE_ACCURACY = 0.99  # copy accuracy needed for fine-grained memory
COARSE_MARGIN = 0.01  # copy must beat LM accuracy by more than this for coarse-grained memory
GRID_KINDS = ("linear", "geometric")
_DECIMALS = 9  # accuracies are rounded before thresholding so float noise cannot move a boundary
_CURVES = ("copy_acc", "copy_std", "lm_acc", "lm_std")


@dataclass
class ForgettingCurveResult:
    """Mean / std accuracy per tested length; fine and coarse memory lengths are derived from the curves."""

    lengths: list[int]
    copy_acc: list[float]
    copy_std: list[float]
    lm_acc: list[float]
    lm_std: list[float]
    n_samples: int
    seed: int
    fine_length: int = field(init=False)
    coarse_length: int = field(init=False)

    def __post_init__(self):
        if any(len(getattr(self, c)) != len(self.lengths) for c in _CURVES):
            raise ValueError("lengths, copy_acc, copy_std, lm_acc and lm_std must have one entry per length")
        x, copy = np.asarray(self.lengths, dtype=np.int64), np.round(self.copy_acc, _DECIMALS)
        gap = np.round(np.subtract(self.copy_acc, self.lm_acc), _DECIMALS)
        self.fine_length = int(x[copy >= FINE_ACCURACY].max(initial=0))
        self.coarse_length = int(x[gap > COARSE_MARGIN].max(initial=0))

    def region(self, length: int) -> str:
        """'fine' up to the fine length, then 'coarse' up to the coarse length, then 'amnesia'."""
        if length <= self.fine_length:
            return "fine"
        return "coarse" if length <= self.coarse_length else "amnesia"

    def rows(self) -> list[dict]:
        """One dict per length: length, copy_acc, copy_std, lm_acc, lm_std, region."""
        return [
            {"length": n, **{c: getattr(self, c)[i] for c in _CURVES}, "region": self.region(n)}
            for i, n in enumerate(self.lengths)
        ]

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["length", *_CURVES, "region"])
            writer.writeheader()
            writer.writerows(self.rows())

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load_json(cls, path: str | Path) -> ForgettingCurveResult:
        data = json.loads(Path(path).read_text())
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.init})


def length_grid(max_len: int, n: int = 32, kind: str = "linear", min_len: int | None = None) -> list[int]:
    """Sorted test lengths from min_len to max_len: n evenly spaced ("linear"; the paper's max/n, 2max/n, ..., max
    by default) or log-spaced ("geometric"). min_len defaults to max_len // n (at least 1). Rounding can merge
    neighbours, so fewer than n lengths may come back."""
    if kind not in GRID_KINDS:
        raise ConfigError(f"Unknown grid kind {kind!r}; choose one of {GRID_KINDS}.")
    if max_len < 1 or n < 1:
        raise ConfigError(f"length_grid needs max_len >= 1 and n >= 1, got max_len={max_len}, n={n}.")
    lo = max(1, max_len // n) if min_len is None else min_len
    if not 1 <= lo <= max_len:
        raise ConfigError(f"min_len must lie in [1, max_len={max_len}], got {lo}.")
    if n == 1:
        return [max_len]
    points = np.linspace(lo, max_len, n) if kind == "linear" else np.geomspace(lo, max_len, n)
    return sorted({round(float(p)) for p in points})


class _Documents:
    """Document extents in a stream of n tokens. Without offsets every token is its own document."""

    def __init__(self, n: int, offsets: Sequence[int] | np.ndarray | None):
        self.n = n
        self.bounds = None
        if offsets is not None:
            o = np.asarray(offsets, dtype=np.int64)
            if o.ndim != 1 or len(o) < 2 or o[0] != 0 or o[-1] != n or np.any(np.diff(o) < 0):
                raise ValueError(
                    f"doc_offsets must be non-decreasing, start at 0 and end at len(tokens)={n} (document i is "
                    "tokens[offsets[i]:offsets[i+1]], as in data.corpus.TokenizedSplit.offsets)."
                )
            self.bounds = np.unique(o)  # empty documents dropped

    def span(self, first: int, last: int) -> tuple[int, int]:
        """[start, end) of the documents holding stream positions first..last."""
        if self.bounds is None:
            return first, last + 1
        b = self.bounds
        return int(b[np.searchsorted(b, first, "right") - 1]), int(b[np.searchsorted(b, last, "right")])

    def target_starts(self, length: int) -> list[tuple[int, int]]:
        """Inclusive ranges of target starts s that leave room for an irrelevant text: s's documents start at or
        after `length` ([a, n - length]), or the last one ends at or before n - length ([0, b - length])."""
        n, b = self.n, self.bounds
        if b is None:
            a, z = length, n - length
        else:
            ia, iz = np.searchsorted(b, length, "left"), np.searchsorted(b, n - length, "right") - 1
            a = int(b[ia]) if ia < len(b) else n + 1
            z = int(b[iz]) if iz >= 0 else -1
        return [(0, z - length), (a, n - length)]


def _draw(rng: np.random.Generator, ranges: list[tuple[int, int]]) -> int:
    """Uniform integer from a union of inclusive ranges (empty ranges ignored, overlaps counted once)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    k = int(rng.integers(sum(hi - lo + 1 for lo, hi in merged)))
    for lo, hi in merged:
        if k <= hi - lo:
            return lo + k
        k -= hi - lo + 1
    raise AssertionError("unreachable: k is below the total count")


def _sample_starts(docs: _Documents, length: int, n_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target and irrelevant starts, (n_samples,) each."""
    rng = np.random.default_rng([seed, length])
    targets, irrelevant = np.empty(n_samples, np.int64), np.empty(n_samples, np.int64)
    for i in range(n_samples):
        s = _draw(rng, docs.target_starts(length))
        lo, hi = docs.span(s, s + length - 1)
        targets[i], irrelevant[i] = s, _draw(rng, [(0, lo - length), (hi, docs.n - length)])
    return targets, irrelevant


def _build_inputs(
    stream: torch.Tensor, targets: np.ndarray, irrelevant: np.ndarray, length: int, bos_id: int, eos_id: int
) -> torch.Tensor:
    """Copy inputs then LM inputs, (2n, 2l + 3)."""
    offsets = torch.arange(length)
    s = stream[torch.as_tensor(targets)[:, None] + offsets]  # (n, l)
    i = stream[torch.as_tensor(irrelevant)[:, None] + offsets]  # (n, l)
    bos, eos = torch.full((len(s), 1), bos_id), torch.full((len(s), 1), eos_id)
    copy = torch.cat([bos, s, bos, s, eos], dim=1)
    lm = torch.cat([bos, i, bos, s, eos], dim=1)
    return torch.cat([copy, lm], dim=0)


def _predict_all(predict: Predictor, input_ids: torch.Tensor, max_batch: int | None) -> torch.Tensor:
    chunks = input_ids.split(max_batch or len(input_ids))
    outputs = []
    for chunk in chunks:
        out = predict(chunk)
        if not isinstance(out, torch.Tensor) or out.shape != chunk.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"predict must return argmax next-token ids shaped like its input {tuple(chunk.shape)}, got "
                f"{shape}; if your model returns logits (B, T, V), return logits.argmax(-1)."
            )
        outputs.append(out)
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _scored_accuracy(input_ids: torch.Tensor, predicted: torch.Tensor, length: int) -> torch.Tensor:
    """Per-row accuracy (B,) over the second half of the second S: positions l+2+l//2 .. 2l+1."""
    first, end = length + 2 + length // 2, 2 * length + 2
    targets = input_ids[:, first:end].to(predicted.device)
    return (predicted[:, first - 1 : end - 1] == targets).float().mean(dim=1).cpu()


def _check_lengths(lengths: Sequence[int], docs: _Documents) -> list[int]:
    lengths = [int(n) for n in lengths]
    if not lengths or lengths[0] < 1 or np.any(np.diff(lengths) <= 0):
        raise ConfigError(
            f"lengths must be strictly increasing positive ints (see length_grid), got {lengths}."
        )
    for n in lengths:
        if all(lo > hi for lo, hi in docs.target_starts(n)):
            where = "" if docs.bounds is None else ", in different documents,"
            raise ConfigError(
                f"Length {n} needs a target and an irrelevant text of {n} tokens each{where} without overlap, "
                f"but the stream has {docs.n} tokens; use shorter lengths or a longer held-out stream."
            )
    return lengths


class _TokenRateColumn(ProgressColumn):
    def render(self, task) -> Text:
        return Text(f"{task.speed or 0:,.0f} tok/s", style="progress.data.speed")


def forgetting_curve(
    predict: Predictor,
    tokens: torch.Tensor | np.ndarray,
    lengths: Sequence[int],
    n_samples: int = 10,
    *,
    bos_id: int,
    eos_id: int,
    seed: int = 0,
    doc_offsets: Sequence[int] | np.ndarray | None = None,
    max_batch: int | None = None,
    progress: bool = True,
) -> ForgettingCurveResult:
    """Copy and LM accuracy curves of `predict` over `lengths` on the held-out stream `tokens` (N,).

    predict: input_ids (B, T) -> argmax ids (B, T), out[b, t] predicting input_ids[b, t + 1]; called under no_grad
    with CPU inputs (move them to the model's device inside). All 2n inputs of a length go in one call, split into
    chunks of at most `max_batch` rows if given. doc_offsets: (n_docs + 1,) document boundaries; the irrelevant
    text then comes from other documents than the target's. Progress (rich, tokens/s and ETA) unless progress=False.
    """
    stream = (
        tokens.cpu().long()
        if isinstance(tokens, torch.Tensor)
        else torch.from_numpy(np.asarray(tokens, np.int64))
    )
    if stream.dim() != 1:
        raise ValueError(f"tokens must be a 1-D token stream, got shape {tuple(stream.shape)}.")
    if n_samples < 1 or (max_batch is not None and max_batch < 1):
        raise ConfigError(f"n_samples and max_batch must be >= 1, got {n_samples} and {max_batch}.")
    docs = _Documents(len(stream), doc_offsets)
    lengths = _check_lengths(lengths, docs)
    stats: dict[str, list[float]] = {c: [] for c in _CURVES}
    columns = (
        TextColumn("forgetting curve l={task.fields[length]}"),
        BarColumn(),
        TaskProgressColumn(),
        _TokenRateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=not progress) as bar, torch.no_grad():
        task = bar.add_task("", total=sum(2 * n_samples * (2 * n + 3) for n in lengths), length=lengths[0])
        for n in lengths:
            bar.update(task, length=n)
            targets, irrelevant = _sample_starts(docs, n, n_samples, seed)
            input_ids = _build_inputs(stream, targets, irrelevant, n, bos_id, eos_id)
            acc = _scored_accuracy(input_ids, _predict_all(predict, input_ids, max_batch), n)
            for name, part in (("copy", acc[:n_samples]), ("lm", acc[n_samples:])):
                stats[f"{name}_acc"].append(part.mean().item())
                stats[f"{name}_std"].append(part.std(correction=0).item())
            bar.advance(task, input_ids.numel())
    return ForgettingCurveResult(lengths=lengths, n_samples=n_samples, seed=seed, **stats)


def plot_forgetting_curve(
    result: ForgettingCurveResult, path: str | Path | None = None, title: str | None = None
) -> Figure:
    """Figure 1 of the paper: copy (solid) and LM (dashed) accuracy with ±std bands over shaded fine-grained
    (green), coarse-grained (blue) and amnesia (red) regions. Agg canvas, no pyplot state; saved if path is given."""
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = np.asarray(result.lengths)
    x_max = int(x.max()) if len(x) else 1
    fine, coarse = result.fine_length, result.coarse_length
    if fine:
        ax.axvspan(0, fine, color="tab:green", alpha=0.15, label=f"fine-grained memory (≤ {fine})")
    if coarse > fine:
        ax.axvspan(fine, coarse, color="tab:blue", alpha=0.12, label=f"coarse-grained memory (≤ {coarse})")
    if max(fine, coarse) < x_max:
        ax.axvspan(max(fine, coarse), x_max, color="tab:red", alpha=0.1, label="amnesia")
    for name, style, color in (("copy", "-", "tab:orange"), ("lm", "--", "tab:purple")):
        mean, std = np.asarray(getattr(result, f"{name}_acc")), np.asarray(getattr(result, f"{name}_std"))
        label = "copy accuracy" if name == "copy" else "LM accuracy"
        ax.plot(x, mean, style, color=color, marker="o", markersize=3, label=label)
        ax.fill_between(x, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1), color=color, alpha=0.2)
    ax.set(xlim=(0, x_max), ylim=(0, 1.02), xlabel="prefix length l (tokens)", ylabel="next-token accuracy")
    ax.set_title(title or f"Forgetting curve ({result.n_samples} samples per length)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ---- framework integration: any task model (`iter_logits`) on a held-out corpus split --------------------------


def model_predictor(model: nn.Module) -> Predictor:
    """`predict` over a task model's `iter_logits` stream (sliding window for CausalLM, segments with the cache
    or memory for Llama-XL / RMT / RMT-R), inputs moved to the model's device and outputs back to the CPU."""
    predict, device = predict_fn(model), next(model.parameters()).device
    return lambda input_ids: predict(input_ids.to(device)).cpu()


def model_forgetting_curve(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    max_len: int = 1024,
    n_lengths: int = 32,
    grid: str = "linear",
    n_samples: int = 10,
    seed: int = 0,
    split: str = "test",
    min_len: int | None = None,
    max_batch: int | None = None,
    progress: bool = True,
) -> ForgettingCurveResult:
    """The forgetting curve of a task model over `length_grid(max_len, n_lengths, grid, min_len)`, samples drawn
    from the tokenized `split` of the corpus (irrelevant texts from other documents than their targets). The
    model runs in eval mode; its mode is restored afterwards."""
    if split not in corpus.splits:
        raise ConfigError(
            f"Corpus {corpus.name!r} has no split {split!r}; choose one of {sorted(corpus.splits)}."
        )
    held_out = tokenize_corpus(corpus, tokenizer)[split]
    was_training = model.training
    model.eval()
    try:
        return forgetting_curve(
            model_predictor(model),
            held_out.tokens,
            length_grid(max_len, n_lengths, grid, min_len),
            n_samples,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            seed=seed,
            doc_offsets=held_out.offsets,
            max_batch=max_batch,
            progress=progress,
        )
    finally:
        model.train(was_training)


def forgetting_metrics(result: ForgettingCurveResult) -> dict[str, float]:
    return {
        "forgetting/fine_len": float(result.fine_length),
        "forgetting/coarse_len": float(result.coarse_length),
    }


def save_forgetting_curve(
    result: ForgettingCurveResult, out_dir: str | Path, title: str | None = None
) -> Path:
    """forgetting_curve.{json,csv,png} into out_dir (created); returns the PNG's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.save_json(out / "forgetting_curve.json")
    result.to_csv(out / "forgetting_curve.csv")
    plot_forgetting_curve(result, out / "forgetting_curve.png", title=title)
    return out / "forgetting_curve.png"


def evaluate_forgetting_curve(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    out_dir: str | Path,
    max_len: int = 1024,
    n_lengths: int = 32,
    grid: str = "linear",
    n_samples: int = 10,
    seed: int = 0,
    split: str = "test",
    min_len: int | None = None,
    max_batch: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Evaluator (configs/eval): the forgetting curve of `model` written to out_dir as forgetting_curve.json /
    .csv / .png; returns `forgetting/fine_len` and `forgetting/coarse_len` (tokens)."""
    result = model_forgetting_curve(
        model,
        tokenizer,
        corpus,
        max_len,
        n_lengths,
        grid,
        n_samples,
        seed,
        split,
        min_len,
        max_batch,
        progress,
    )
    save_forgetting_curve(
        result, out_dir, title=f"Forgetting curve of {type(model).__name__} ({split} split)"
    )
    return forgetting_metrics(result)


class ForgettingCurveCallback(EvaluatorCallback):
    """Every `every_n_val`-th validation: a small forgetting curve on the datamodule's corpus, logged as
    `val/forgetting/fine_len` and `val/forgetting/coarse_len`, the curves as the W&B table `val/forgetting`
    and the plot `val/forgetting/plot`; JSON/CSV/PNG under `<out_dir>/step<global step>/`."""

    name = "forgetting"

    def __init__(
        self,
        every_n_val: int = 1,
        max_len: int = 512,
        n_lengths: int = 8,
        n_samples: int = 4,
        grid: str = "linear",
        split: str = "validation",
        seed: int = 0,
        max_batch: int | None = None,
        out_dir: str | None = None,
    ):
        super().__init__(every_n_val, out_dir)
        length_grid(
            max_len, n_lengths, grid
        )  # a bad grid fails at construction, not after the first validation
        self.kwargs = dict(
            max_len=max_len, n_lengths=n_lengths, grid=grid, n_samples=n_samples, seed=seed, split=split
        )
        self.max_batch = max_batch

    def evaluate(
        self, model: nn.Module, tokenizer: Tokenizer, corpus: Corpus, out_dir: Path
    ) -> EvaluatorReport:
        result = model_forgetting_curve(
            model, tokenizer, corpus, **self.kwargs, max_batch=self.max_batch, progress=False
        )
        png = save_forgetting_curve(result, out_dir, title=f"Forgetting curve, {out_dir.name}")
        columns = ["length", *_CURVES, "region"]
        rows = [[row[c] for c in columns] for row in result.rows()]
        return EvaluatorReport(forgetting_metrics(result), columns, rows, png)
