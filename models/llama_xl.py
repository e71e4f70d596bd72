"""Llama-XL (Liu et al. 2024, "Forgetting Curve", App. D.2): a Transformer-XL-style Llama.

Each layer attends over [cached keys/values of the previous segment; this segment] (`models.kv_cache`). Keys are
L2-normalised over the head dimension (`LlamaConfig.key_norm`; off for a pretrained Llama run as it was trained)
and cached un-rotated; RoPE positions run 0..len(k_hat)-1 for the keys and the last len(q) of those for the
queries, with a bottom-right causal mask, so no position beyond cache + segment is ever used. The weights are exactly our Llama's (a baseline or Hugging Face
Llama checkpoint loads unchanged); only the key normalisation and the cache differ.

Training (`forward`) cuts the batch's T tokens into segments of `segment_size` (the last one may be shorter) and
keeps the cache on the module between calls, so a stream continues across the batches of the ordered loader; rows
with `batch["reset"]` restart, a batch without `reset` is a fresh set of streams. Training and evaluation keep
separate caches, so validation never disturbs the training streams. The cache is not part of the state dict: a
resumed run starts with an empty cache (its first batch sees no earlier segment).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from models.config_errors import ConfigError
from models.kv_cache import XLKVCache
from models.llama import Llama
from models.outputs import ModelOutput, head_logprobs, scored_positions


class LlamaXL(nn.Module):
    """Segment-recurrent task model over a `Llama` backbone, built with `key_norm=True` as in the paper; a
    pretrained Llama (e.g. SmolLM2) can run with its keys as trained (`key_norm=False`, `attn_scale=None`).

    cache_tokens: keep the last N tokens as context, or cache_segments: the last m segments (the paper: m = 1).
    detach_cache: stop gradients at the cache (Transformer-XL); False lets a segment's loss reach the earlier
    segments of the same batch through the cached keys/values (the cache is always cut between batches).
    """

    def __init__(
        self,
        backbone: Llama,
        segment_size: int,
        cache_tokens: int | None = None,
        cache_segments: int | None = None,
        detach_cache: bool = True,
    ):
        super().__init__()
        if not isinstance(backbone, Llama):
            raise ConfigError(
                f"Llama-XL needs our Llama backbone (it has the per-layer KV-cache hook), got {type(backbone).__name__}"
            )
        if segment_size < 1:
            raise ConfigError(f"segment_size must be >= 1, got {segment_size}")
        if (cache_tokens is None) == (cache_segments is None):
            raise ConfigError(
                f"Give exactly one of cache_tokens / cache_segments, got {cache_tokens} / {cache_segments} "
                "(cache_segments=1: the previous segment, as in the paper)"
            )
        self.backbone, self.segment_size, self.detach_cache = backbone, segment_size, detach_cache
        self.cache_tokens, self.cache_segments = cache_tokens, cache_segments
        self.new_cache()  # validates the cache size
        span = segment_size + (cache_tokens if cache_tokens is not None else cache_segments * segment_size)
        if span > backbone.cfg.max_positions:
            raise ConfigError(
                f"Keys span up to {span} positions (cache + segment) but the backbone has max_positions="
                f"{backbone.cfg.max_positions}; lower segment_size / the cache size or raise max_positions"
            )
        self._streams: dict[bool, XLKVCache] = {}  # training-mode flag -> cache carried between forward calls

    def new_cache(self) -> XLKVCache:
        return XLKVCache(self.cache_tokens, self.cache_segments, detach=self.detach_cache)

    def _segment(self, input_ids: Tensor, mask: Tensor | None, cache: XLKVCache) -> Tensor:
        """One segment (B, T) through the backbone with the cache -> hidden (B, T, D)."""
        if mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        key_mask = cache.begin(mask)  # (B, Tc + T)
        return self.backbone(input_ids=input_ids, attention_mask=key_mask, kv_cache=cache)

    def _stream_cache(self, batch: dict) -> XLKVCache:
        """The cache of the current mode, its restarted rows dropped; a batch without `reset` restarts all."""
        B = batch["input_ids"].shape[0]
        cache = self._streams.setdefault(self.training, self.new_cache())
        reset = batch.get("reset")
        if reset is None or bool(reset.all()):
            cache.clear()
        elif cache.batch_size not in (None, B):
            raise ValueError(
                f"The batch has {B} rows but the cached streams {cache.batch_size}, and not every row is reset; "
                "the ordered loader must keep its batch size (or set reset=True on every row)"
            )
        else:
            cache.reset(reset)
        cache.detach_()  # the previous batch's graph is gone after its backward
        return cache

    def scored_hidden(self, batch: dict, cached: bool = True) -> Tensor:
        """Hidden states (N, D) at the scored positions. cached=False: every segment alone, without the cache
        (the carried streams are left alone)."""
        ids, S = batch["input_ids"], self.segment_size
        mask = batch.get("attention_mask")
        stream = self._stream_cache(batch) if cached else None
        segments = [
            self._segment(
                ids[:, a : a + S],
                None if mask is None else mask[:, a : a + S],
                stream if cached else self.new_cache(),
            )
            for a in range(0, ids.shape[1], S)
        ]
        return torch.cat(segments, dim=1)[scored_positions(batch["labels"])]

    def forward(self, batch: dict) -> ModelOutput:
        labels = batch["labels"]
        return ModelOutput(self.backbone.head(self.scored_hidden(batch)), labels[scored_positions(labels)])

    @torch.no_grad()
    def short_context_logprobs(
        self, batch: dict, out: ModelOutput, K: int | None = None, d: int | None = None
    ) -> Tensor:
        """log P(target) (N,) from each segment alone (no cached keys/values), for LongCE; no grad.
        K and d (the sliding window of CausalLM) do not apply: the segment is the short context."""
        return head_logprobs(self.backbone.head, self.scored_hidden(batch, cached=False), out.targets)

    @torch.no_grad()
    def iter_logits(self, input_ids: Tensor) -> Iterator[Tensor]:
        """Logits (B, T_i, V) segment by segment with a fresh cache (the training streams are left alone)."""
        cache = self.new_cache()
        for seg in input_ids.split(self.segment_size, dim=1):
            yield self.backbone.head(self._segment(seg, None, cache))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, eos_id: int) -> list[list[int]]:
        """Greedy continuation of each prompt row (B, T) until EOS or `max_new_tokens`.

        Segments are cut from the start of the prompt as in `iter_logits`, so each choice is the argmax that
        `iter_logits` gives over prompt + continuation. The open segment is recomputed on a fork of the cache for
        every new token and committed once full: O(segment_size) positions per token.
        """
        S = self.segment_size
        cache = self.new_cache()
        n_closed = (input_ids.shape[1] - 1) // S * S  # tokens in full segments before the open one
        for seg in input_ids[:, :n_closed].split(S, dim=1):
            self._segment(seg, None, cache)
        open_seg = input_ids[:, n_closed:]  # (B, 1..S)
        out, done = [[] for _ in range(len(input_ids))], torch.zeros(len(input_ids), dtype=torch.bool)
        for _ in range(max_new_tokens):
            trial = cache.fork()
            nxt = self.backbone.head(self._segment(open_seg, None, trial)[:, -1]).argmax(-1)  # (B,)
            for b in (~done).nonzero().flatten().tolist():
                out[b].append(int(nxt[b]))
            done |= (nxt == eos_id).cpu()
            if done.all():
                break
            if open_seg.shape[1] == S:
                cache, open_seg = trial, nxt[:, None]
            else:
                open_seg = torch.cat([open_seg, nxt[:, None]], dim=1)
        return out


def build_llama_xl(
    backbone: Llama,
    segment_size: int,
    cache_tokens: int | None = None,
    cache_segments: int | None = 1,
    detach_cache: bool = True,
) -> LlamaXL:
    """Hydra target of configs/model/llama_xl.yaml. cache_tokens, when given, replaces cache_segments."""
    if cache_tokens is not None:
        cache_segments = None
    return LlamaXL(backbone, segment_size, cache_tokens, cache_segments, detach_cache)
