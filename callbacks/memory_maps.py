"""What RMT's memory does along a long sample (Kuratov et al. 2024, Fig. 10).

(a, b) Pairwise L2 distances between the memory states M_0 .. M_n of one sample: memory barely moves over
background and jumps where a fact is written. (c, d) Attention over memory: the write memory attending to the
segment that changes memory most (writing a fact), and the last segment's tokens attending to the read memory
(reading it to answer).

ARMT carries its associative matrices (models/armt.py): their distances are drawn with the memory tokens', and
with the paper's layout (no read memory) there is no read map: its segments read memory inside every layer.

Attention probabilities are re-derived from hooks on the inputs of our Llama's attention layers (queries, keys,
rotary positions and mask exactly as the layer builds them), averaged over heads and layers. Hugging Face backbones
hide these internals, so with them only the distance map is drawn (`attention_maps` raises a clear error).

Plain functions return the heat maps (`Panel`s) and draw them as one matplotlib figure; `MemoryMapsCallback` draws
them for a few validation samples into one PNG in the run folder and logs it to W&B when a W&B logger is attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from models.llama import Attention, Llama, allowed_keys, apply_rope
from models.memory import MemoryState
from models.rmt import RMT


def carried(state: MemoryState) -> Tensor:
    """What a one-row state carries into the next segment, flattened (N,): its memory tokens and, for ARMT, its
    associative matrices (RMT-R's bank is the history of the tokens, not more state)."""
    parts = [state.memory[0].flatten()]
    if state.associative is not None:
        parts.append(state.associative.A[0].flatten())
    return torch.cat(parts).float()


@torch.no_grad()
def memory_states(model: RMT, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Memory states M_0 .. M_n (n + 1, N) of one sample input_ids (T,) (padding allowed, mask (T,)), flattened
    as in `carried`."""
    ids = input_ids[None]
    mask = None if attention_mask is None else attention_mask[None]
    state = model.initial_state(1)
    states = [carried(state)]
    for a, b in model.segment_bounds(ids.shape[1]):
        _, state = model.run_segment(state, ids[:, a:b], None if mask is None else mask[:, a:b])
        states.append(carried(state))
    return torch.stack(states)


def memory_moves(states: Tensor) -> Tensor:
    """How far each segment moves memory: ||M_t - M_{t-1}|| for t = 1..n, (n,), from states (n + 1, N)."""
    return (states[1:] - states[:-1]).norm(dim=-1)


@dataclass
class Panel:
    """One heat map of Figure 10: values (rows, cols) and its labels."""

    values: np.ndarray
    title: str
    xlabel: str
    ylabel: str
    label: str  # of the colour bar
    cmap: str
    integer_ticks: bool = False
    marks: tuple[int, ...] = ()  # rows and columns to mark (memory states written after a fact)


def distance_panel(states: Tensor, facts: tuple[int, ...] = ()) -> Panel:
    """Distances (n + 1, n + 1) between flattened memory states (n + 1, m, D); `facts`: the states M_t written
    after a segment holding a fact, marked with dotted lines."""
    flat = states.flatten(1)
    dist = torch.cdist(flat[None], flat[None])[0].cpu().numpy()
    return Panel(
        dist,
        "Memory states: L2 distance" + ("\n(dotted: after a fact)" if facts else ""),
        "memory state t",
        "memory state t",
        "distance (red = similar)",
        "coolwarm_r",
        integer_ticks=True,
        marks=tuple(facts),
    )


def fact_segments(input_ids: np.ndarray, facts: list[np.ndarray], bounds: list[tuple[int, int]]) -> list[int]:
    """1-based index t of the segment where each fact (in story order) ends in a sample's ids (T,): memory state M_t
    is the first written after the whole fact. Facts are found as token subsequences, in story order."""
    found, start = [], 0
    for fact in facts:
        hits = [
            int(i)
            for i in np.flatnonzero(input_ids[start:] == fact[0]) + start
            if np.array_equal(input_ids[i : i + len(fact)], fact)
        ]
        if not hits:
            raise ValueError(f"fact {fact.tolist()} is not in the sample after position {start}")
        start = hits[0] + len(fact)
        found.append(next(t for t, (a, b) in enumerate(bounds, 1) if a <= start - 1 < b))
    return found


def fact_segments_of(dataset, i: int, model: RMT) -> tuple[list[int], int]:
    """`fact_segments` of sample i of a generated BABILong test set (a `HaystackSet`) under the model's
    segmentation, and the sample's number of segments (the question's is the last)."""
    ids = dataset[i].input_ids
    bounds = model.segment_bounds(len(ids))
    return fact_segments(ids, dataset.tasks.facts[dataset.indices[i]], bounds), len(bounds)


def attention_probs(attn: Attention, x: Tensor, rope_for, mask_for) -> Tensor:
    """Probabilities (B, H, T, T) of one of our Llama's attention layers, from its inputs (as the layer gets them:
    normed hidden states x (B, T, D), its rotary and mask builders), without a KV cache; stick-breaking heads'
    weights sum to at most 1."""
    cfg, (B, T, _) = attn.cfg, x.shape
    q = attn.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    if cfg.key_norm:
        k = F.normalize(k, dim=-1)
    k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=1)
    scale, mask, S = cfg.score_scale, mask_for(T), cfg.stick_breaking_heads
    allowed = allowed_keys(mask, T, T, x.device)
    stick = [attn.stick_weights(q[:, :S], k[:, :S], allowed)] if S else []  # the first S heads
    cos, sin = (t.to(q.dtype) for t in rope_for(T))
    q, k = apply_rope(q[:, S:], cos, sin), apply_rope(k[:, S:], cos, sin)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H - S, T, T)
    if mask is not None and mask.is_floating_point():  # an ALiBi bias, -inf where attending is not allowed
        return torch.cat([*stick, (scores + mask).softmax(-1)], 1)
    return torch.cat([*stick, scores.masked_fill(~allowed, float("-inf")).softmax(-1)], 1)


@torch.no_grad()
def attention_maps(model: RMT, state: MemoryState, input_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """Attention probabilities (Tq, Tk) of one segment [read; tokens; write] (input_ids (1, L)), mean over layers
    and heads, re-derived from each attention layer's inputs. Needs our Llama backbone."""
    backbone = model.backbone
    if not isinstance(backbone, Llama):
        raise TypeError(
            f"Attention maps need our Llama backbone (backbone=tiny|llama_83m|smollm2_135m), got "
            f"{type(backbone).__name__}: Hugging Face models do not expose their attention inputs."
        )
    maps: list[Tensor] = []

    def capture(attn, args, _output):
        maps.append(attention_probs(attn, *args[:3]).float().mean(1)[0])

    handles = [layer.self_attn.register_forward_hook(capture) for layer in backbone.layers]
    try:
        # eager even where the backbone is compiled (compile=true): the hooks must see every attention layer's inputs
        with torch.compiler.set_stance("force_eager"):
            model.run_segment(state, input_ids, mask)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(maps).mean(0)


@torch.no_grad()
def memory_panels(
    model: RMT,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    n_query: int = 16,
    facts: tuple[int, ...] = (),
) -> dict[str, Panel]:
    """Figure 10 for one sample (T,): {"distance", and with our Llama "write", "read"}; `facts` (`fact_segments`)
    marks the memory states written after a fact.

    write: the write memory of the segment where memory moved most, over [read memory; tokens]: among the fact
    segments when `facts` are given, else among all but the first (whose move from M_0 is not a write of content).
    read: the last `n_query` tokens of the last segment (question and answer) over the read memory (none without
    read memory: ARMT's paper layout).
    """
    states = memory_states(model, input_ids, attention_mask)
    panels = {"distance": distance_panel(states, facts)}
    if not isinstance(model.backbone, Llama):
        return panels
    bounds = model.segment_bounds(len(input_ids))
    moves = memory_moves(states)  # (n,)
    ids, mask = input_ids[None], None if attention_mask is None else attention_mask[None]
    candidates = [t - 1 for t in facts] if facts else list(range(min(1, len(moves) - 1), len(moves)))
    maps = [("write", max(candidates, key=lambda i: float(moves[i])))]
    if model.read_memory(model.initial_state(1)).shape[1]:
        maps.append(("read", len(bounds) - 1))
    for name, t in maps:
        state = model.initial_state(1)
        for a, b in bounds[:t]:
            _, state = model.run_segment(state, ids[:, a:b], None if mask is None else mask[:, a:b])
        a, b = bounds[t]
        probs = (
            attention_maps(model, state, ids[:, a:b], None if mask is None else mask[:, a:b]).cpu().numpy()
        )
        r, L = model.read_memory(state).shape[1], b - a
        if name == "write":
            block = probs[r + L :, : r + L]
            labels = ("read memory | segment tokens" if r else "segment tokens", "write memory")
        else:
            block, labels = probs[max(r, r + L - n_query) : r + L, :r], ("read memory", "last tokens")
        title = f"{'Writing' if name == 'write' else 'Reading'}: segment {t + 1}"
        panels[name] = Panel(block, title, *labels, "attention", "Reds")
    return panels


def memory_figure(samples: list[dict[str, Panel]]) -> Figure:
    """One figure for a validation: a row per sample, its panels side by side."""
    cols = max(len(panels) for panels in samples)
    fig = Figure(figsize=(5.2 * cols, 3.8 * len(samples)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(samples), cols, squeeze=False)
    for i, panels in enumerate(samples):
        for ax, panel in zip(axes[i], [*panels.values(), *[None] * cols], strict=False):
            if panel is None:
                ax.remove()
                continue
            image = ax.imshow(panel.values, cmap=panel.cmap, aspect="auto", interpolation="nearest")
            ax.set(title=f"sample {i}: {panel.title}", xlabel=panel.xlabel, ylabel=panel.ylabel)
            if panel.integer_ticks:
                for axis in (ax.xaxis, ax.yaxis):
                    axis.set_major_locator(MaxNLocator(integer=True))
            for t in panel.marks:
                ax.axvline(t, color="black", lw=0.8, ls=":")
                ax.axhline(t, color="black", lw=0.8, ls=":")
            fig.colorbar(image, ax=ax, label=panel.label)
    return fig


class MemoryMapsCallback(L.Callback):
    """Draws Figure 10 for the first `n_samples` rows of the first batch of validation loader `dataloader_idx`
    (-1: the last, usually the longest) every `every_n_validations` validations: one image, `<run dir>/memory_maps.png`
    (overwritten: the newest), logged to W&B as `val/memory_maps` at the step (W&B keeps every one)."""

    def __init__(self, n_samples: int = 2, dataloader_idx: int = -1, every_n_validations: int = 1):
        self.n_samples, self.dataloader_idx, self.every = n_samples, dataloader_idx, every_n_validations
        self._validations = 0

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validations += 1

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        model = pl_module.model
        if (
            not isinstance(model, RMT)
            or batch_idx != 0
            or trainer.sanity_checking
            or not trainer.is_global_zero
        ):
            return
        n_loaders = len(trainer.val_dataloaders) if isinstance(trainer.val_dataloaders, list) else 1
        if dataloader_idx != self.dataloader_idx % n_loaders or self._validations % self.every:
            return
        mask = batch.get("attention_mask")
        rows = range(min(self.n_samples, len(batch["input_ids"])))
        samples = [
            memory_panels(model, batch["input_ids"][i], None if mask is None else mask[i]) for i in rows
        ]
        path = Path(trainer.default_root_dir) / "memory_maps.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        memory_figure(samples).savefig(path, dpi=100)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="val/memory_maps", images=[str(path)], step=trainer.global_step)
