"""Segment-level key/value cache of Llama-XL (Liu et al. 2024, App. D.2, Eq. 3-4; after Dai et al. 2019).

For each layer it holds the un-rotated keys and values of the last segments of B parallel streams, plus which cached
tokens are real (padding and rows whose stream restarted are masked). One segment goes through the backbone as:

    key_mask = cache.begin(segment_mask)              # (B, Tc + T): [cached tokens; this segment] real?
    hidden = backbone(..., attention_mask=key_mask, kv_cache=cache)
        # every layer: k_hat, v_hat = cache.update(layer, k, v) -> [cache; new], and the cache keeps the window

The kept window is the last `max_tokens` tokens or the last `max_segments` segments of [cache; new]. Stored
tensors are detached unless `detach=False`; then a segment's loss reaches back through the cache into the segments
before it, for as long as their graph lives (`detach_()` cuts it, e.g. at a batch boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.config_errors import ConfigError


@dataclass
class _Segment:
    """The segment in flight: set by `begin`, consumed layer by layer by `update`."""

    cached: int  # tokens in the cache before this segment
    length: int  # tokens in this segment
    keep: int  # tokens the cache keeps after it
    done: set[int] = field(default_factory=set)  # layers already updated


class XLKVCache:
    """Per-layer keys/values (B, H_kv, Tc, hd) of the previous segment(s) of B streams, Tc the same for all layers.

    Give exactly one of max_tokens (keep the last N tokens) or max_segments (keep the last m segments).
    """

    def __init__(self, max_tokens: int | None = None, max_segments: int | None = None, detach: bool = True):
        if (max_tokens is None) == (max_segments is None):
            raise ConfigError(
                f"Give exactly one of max_tokens / max_segments, got {max_tokens} / {max_segments} "
                "(e.g. max_segments=1: the previous segment, as in the paper)"
            )
        if (max_tokens or max_segments) < 1:
            raise ConfigError(
                f"cache size must be >= 1, got max_tokens={max_tokens}, max_segments={max_segments}"
            )
        self.max_tokens, self.max_segments, self.detach = max_tokens, max_segments, detach
        self.clear()

    def clear(self) -> None:
        """Forget everything (all streams restart)."""
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.valid: Tensor | None = None  # (B, Tc) bool: cached token is real
        self.segment_lengths: list[int] = []  # lengths of the cached segments, oldest first
        self._segment: _Segment | None = None

    @property
    def length(self) -> int:
        """Cached tokens Tc (real or masked)."""
        return 0 if self.valid is None else self.valid.shape[1]

    @property
    def batch_size(self) -> int | None:
        return None if self.valid is None else self.valid.shape[0]

    def begin(self, segment_mask: Tensor) -> Tensor:
        """Start a segment whose tokens are real where segment_mask (B, T) is nonzero.

        Returns the key mask (B, Tc + T) for attention over [cache; segment] and fixes the window every layer's
        `update` keeps. Call once per segment, before the backbone forward.
        """
        B, T = segment_mask.shape
        if self.valid is not None and B != self.valid.shape[0]:
            raise ValueError(
                f"The cache holds {self.valid.shape[0]} streams but the segment has {B} rows; clear() it first"
            )
        new = segment_mask.bool()
        key_mask = new if self.valid is None else torch.cat([self.valid, new], dim=1)
        if self.max_segments is not None:
            self.segment_lengths = [*self.segment_lengths, T][-self.max_segments :]
            keep = sum(self.segment_lengths)
        else:
            keep = min(key_mask.shape[1], self.max_tokens)
        self._segment = _Segment(cached=self.length, length=T, keep=keep)
        self.valid = key_mask[:, key_mask.shape[1] - keep :]
        return key_mask

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, H_kv, T, hd) of this segment -> [cache; k], [cache; v] (B, H_kv, Tc + T, hd); keeps the window."""
        seg = self._segment
        if seg is None:
            raise RuntimeError("Call cache.begin(segment_mask) before the backbone forward of each segment")
        old_k, old_v = self.keys.get(layer), self.values.get(layer)
        cached = 0 if old_k is None else old_k.shape[2]
        if layer in seg.done or cached != seg.cached or k.shape[2] != seg.length:
            raise RuntimeError(
                f"Layer {layer} update does not match the segment begun ({seg.length} new tokens after "
                f"{seg.cached} cached; got {k.shape[2]} after {cached}, repeat={layer in seg.done}); "
                "call begin() once per segment and update() once per layer"
            )
        seg.done.add(layer)
        k_all = k if old_k is None else torch.cat([old_k, k], dim=2)
        v_all = v if old_v is None else torch.cat([old_v, v], dim=2)
        start = k_all.shape[2] - seg.keep
        k_keep, v_keep = k_all[:, :, start:], v_all[:, :, start:]
        if self.detach:
            k_keep, v_keep = k_keep.detach(), v_keep.detach()
        self.keys[layer], self.values[layer] = k_keep, v_keep
        return k_all, v_all

    def reset(self, rows: Tensor) -> None:
        """Drop the cache of the streams that restart: rows (B,) bool. Their cached tokens are zeroed and masked."""
        if self.valid is None:
            return
        if rows.shape != (self.valid.shape[0],):
            raise ValueError(f"reset rows must have shape ({self.valid.shape[0]},), got {tuple(rows.shape)}")
        rows = rows.to(device=self.valid.device, dtype=torch.bool)
        if bool(rows.all()):
            self.clear()
            return
        self.valid = self.valid & ~rows[:, None]
        drop = rows[:, None, None, None]
        self.keys = {i: t.masked_fill(drop, 0) for i, t in self.keys.items()}
        self.values = {i: t.masked_fill(drop, 0) for i, t in self.values.items()}

    def detach_(self) -> None:
        """Cut the autograd graph behind the cached tensors (their values stay)."""
        self.keys = {i: t.detach() for i, t in self.keys.items()}
        self.values = {i: t.detach() for i, t in self.values.items()}

    def fork(self) -> XLKVCache:
        """A cache with the same contents whose updates leave this one unchanged (tensors are never modified
        in place, so they are shared)."""
        other = XLKVCache(self.max_tokens, self.max_segments, self.detach)
        other.keys, other.values = dict(self.keys), dict(self.values)
        other.valid, other.segment_lengths = self.valid, list(self.segment_lengths)
        return other
