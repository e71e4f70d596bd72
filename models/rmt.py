"""Recurrent Memory Transformer (Bulatov et al. 2022; the BABILong setup of Kuratov et al. 2024, Sec. 4).

A memory cell around ANY backbone of the protocol (models/backbone.py), which it leaves unchanged. The input is
split FROM THE RIGHT into segments X_1..X_n of `segment_size` tokens (the first may be shorter; batches are
left-padded, so the question and answer sit in the last segment). Segment t runs as

    [read memory; X_t; write memory] = [M_{t-1}; X_t; M_{t-1}]  ->  backbone  ->  hidden (B, r + L + m, D)

and the backbone's last (final-normed) hidden states at the write positions become M_t, as in the reference
implementation, where M_t is `hidden_states[-1]` of the HF model, i.e. the output of the final norm. M_0 is a
learned (m, D) parameter, initialised normal with the token embeddings' std.

`memory_scale` s multiplies the read and write memory as they enter the backbone, [s M_{t-1}; X_t; s M_{t-1}]
(M_t itself stays the final-normed output): the final norm writes memory at about sqrt(D) per token while the
layers add updates of several times that to its residual stream, so with s = 1 every segment rewrites most of what
the memory carried; s of about 16 puts it at the stream's scale (docs/babilong_long_stages.md).

Positions count memory and real tokens: read memory 0..r-1, then the segment's real tokens, then the write memory
(padding shifts nothing); memory is always attended, padding never. A row whose segment is all padding keeps its
memory, so extra left padding changes no result.

Backprop through time with depth k2: the memory entering a segment is detached at the start of every block of
k2 + 1 segments, blocks aligned to the last segment. So the answer (last segment) back-propagates through exactly
k2 memory transitions, and no loss anywhere through more (k2 = -1: full BPTT; k2 = 0: every transition cut).

Subclasses change the hooks `initial_state`, `read_memory` (what precedes the segment), `write_memory` (what follows
it), `next_state` and `restart_rows` (RMT-R adds retrieval from a bank of past states, models/rmt_retrieval.py; ARMT
an associative memory in every layer, models/armt.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.config_errors import ConfigError
from models.llama import padding_position_ids
from models.memory import MemoryState
from models.outputs import ModelOutput, head_logprobs, scored_positions


class RMT(nn.Module):
    """Backbone + m memory tokens, segment-level recurrence. The LM head runs only at scored positions."""

    def __init__(
        self,
        backbone: nn.Module,
        num_memory: int,
        segment_size: int,
        k2: int = -1,
        checkpoint_segments: bool = False,
        alibi_free_memory: bool = False,
        memory_scale: float = 1.0,
    ):
        super().__init__()
        if not memory_scale > 0:
            raise ConfigError(
                f"memory_scale multiplies the memory fed to the backbone: it must be > 0, got {memory_scale}"
            )
        if num_memory < 0:
            raise ConfigError(f"num_memory must be >= 0, got {num_memory}")
        if segment_size < 1:
            raise ConfigError(f"segment_size must be >= 1, got {segment_size}")
        if k2 < -1:
            raise ConfigError(f"k2 must be -1 (full backprop through time) or >= 0, got {k2}")
        self.backbone = backbone
        self.num_memory = num_memory
        self.segment_size = segment_size
        self.k2 = k2
        self.checkpoint_segments = checkpoint_segments
        if alibi_free_memory and not getattr(getattr(backbone, "cfg", None), "alibi", False):
            raise ConfigError(
                "model.alibi_free_memory=true exempts the memory tokens from ALiBi's recency bias: it needs a "
                "backbone with ALiBi (backbone.alibi=true, as backbone=tiny_babi)"
            )
        self.alibi_free_memory = alibi_free_memory
        self.memory_scale = memory_scale
        with torch.no_grad():
            ids = torch.arange(backbone.vocab_size, device=_device_of(backbone))
            emb = backbone.embed(ids)
        self.memory = nn.Parameter(
            torch.randn(num_memory, backbone.hidden_size, dtype=emb.dtype, device=emb.device) * emb.std()
        )
        # stream mode: the state carried between batches, per train/eval mode
        self._carried: dict[bool, MemoryState] = {}

    # ---- hooks (RMT-R overrides them) ------------------------------------------------------------------
    def initial_state(self, batch_size: int) -> MemoryState:
        """M_0 for every row: memory (B, m, D)."""
        return MemoryState(self.memory.expand(batch_size, -1, -1))

    def read_memory(self, state: MemoryState) -> Tensor:
        """What precedes the segment's tokens: (B, r, D); RMT: M_{t-1} (r = m)."""
        return state.memory

    def write_memory(self, state: MemoryState) -> Tensor:
        """What follows the segment's tokens: (B, m, D), whose outputs are the new memory; RMT: M_{t-1}."""
        return state.memory

    def next_state(self, state: MemoryState, new_memory: Tensor, has_tokens: Tensor) -> MemoryState:
        """State after a segment: new_memory (B, m, D) where the row had real tokens (B,), else unchanged."""
        return MemoryState(torch.where(has_tokens[:, None, None], new_memory, state.memory))

    def restart_rows(self, state: MemoryState, rows: Tensor) -> MemoryState:
        """State with the rows where `rows` (B,) is True back at M_0 (stream mode: a new document starts)."""
        fresh = self.initial_state(state.batch_size).memory
        return MemoryState(torch.where(rows[:, None, None], fresh, state.memory))

    # ---- one segment -----------------------------------------------------------------------------------
    def run_segment(
        self,
        state: MemoryState,
        input_ids: Tensor,
        mask: Tensor | None,
        write: bool = True,
        **backbone_kwargs,
    ) -> tuple[Tensor, MemoryState | None]:
        """[read memory; tokens; write memory] through the backbone.

        input_ids (B, L), mask (B, L) 0/1 or None (all real); backbone_kwargs go to the backbone (ARMT: its
        per-layer hook). Returns the tokens' hidden states (B, L, D) and the next state (None when `write` is False,
        as when generating).
        """
        read = self.read_memory(state) * self.memory_scale  # (B, r, D)
        write_in = [self.write_memory(state) * self.memory_scale] if write else []
        parts = [read, self.backbone.embed(input_ids), *write_in]
        x = torch.cat(parts, 1)  # (B, r + L [+ m], D)
        r, L = read.shape[1], input_ids.shape[1]
        if mask is None or bool(mask.all()):
            # (1, T): one row for all, so RoPE and an ALiBi bias are built once, not once per row
            attention_mask, positions = None, torch.arange(x.shape[1], device=x.device)[None]
        else:
            memory_mask = [mask.new_ones(len(x), self.num_memory)] if write else []
            attention_mask = torch.cat([mask.new_ones(len(x), r), mask, *memory_mask], 1)
            positions = padding_position_ids(attention_mask)
        if self.alibi_free_memory:  # read and write memory at distance 0 from every token
            index = torch.arange(x.shape[1], device=x.device)
            backbone_kwargs["alibi_free"] = (index < r) | (index >= r + L)
        hidden = self.backbone(
            inputs_embeds=x, position_ids=positions, attention_mask=attention_mask, **backbone_kwargs
        )
        if not write:
            return hidden[:, r:], None
        return hidden[:, r : r + L], self.next_state(
            state, hidden[:, r + L :], rows_with_tokens(input_ids, mask)
        )

    def _step(self, state: MemoryState, input_ids: Tensor, mask: Tensor | None) -> tuple[Tensor, MemoryState]:
        if self.checkpoint_segments and self.training and torch.is_grad_enabled():
            return checkpoint(self.run_segment, state, input_ids, mask, use_reentrant=False)
        return self.run_segment(state, input_ids, mask)

    # ---- whole sequences -------------------------------------------------------------------------------
    def segment_bounds(self, length: int) -> list[tuple[int, int]]:
        """(start, end) of each segment, split from the right: the first one may be shorter."""
        ends = list(range(length, 0, -self.segment_size))[::-1]
        return [(max(0, end - self.segment_size), end) for end in ends]

    def cuts_gradient(self, index: int, n_segments: int) -> bool:
        """True where the memory entering segment `index` (0-based, of `n_segments`) is detached (k2, above)."""
        return self.k2 >= 0 and index > 0 and (n_segments - 1 - index) % (self.k2 + 1) == self.k2

    def needs_graph(self, scored: Tensor, bounds: list[tuple[int, int]], recurrent: bool) -> list[bool]:
        """Per segment: whether any loss reaches it. Where none does (no scored token in it or after it before the
        next cut of truncated BPTT, or grad off) it runs without an autograd graph: an answer after 512 segments
        with k2 = 31 keeps activations of, and back-propagates through, the last 32 only. scored (B, T) bool."""
        if not torch.is_grad_enabled():
            return [False] * len(bounds)
        has_scored = scored.any(0).tolist()
        graph, later = [False] * len(bounds), False  # later: a loss after segment i reaches back to it
        for i in reversed(range(len(bounds))):
            a, b = bounds[i]
            graph[i] = any(has_scored[a:b]) or later
            later = graph[i] and recurrent and not self.cuts_gradient(i, len(bounds))
        return graph

    def start_state(self, batch: dict) -> MemoryState:
        """M_0, or in stream mode (a `reset` key in the batch) the carried state with reset rows restarted."""
        B = batch["input_ids"].shape[0]
        if "reset" not in batch:
            return self.initial_state(B)
        reset = batch["reset"].bool()
        carried = self._carried.get(self.training)
        if carried is None or carried.batch_size != B:
            if carried is not None and not bool(reset.all()):
                raise ValueError(
                    f"Stream batch of {B} rows continues a stream of {carried.batch_size} rows; keep the batch size "
                    "fixed in an ordered loader (drop_last=True) or start it with reset=True on every row."
                )
            return self.initial_state(B)
        return self.restart_rows(carried, reset)

    def scored_hidden(self, batch: dict, recurrent: bool = True) -> Tensor:
        """Hidden states (N, D) at the scored positions, row-major. recurrent=False: memory reset every segment."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        mask = batch.get("attention_mask")
        B, T = input_ids.shape
        scored = scored_positions(labels)
        flat_index = torch.arange(B * T, device=input_ids.device).view(B, T)
        bounds = self.segment_bounds(T)
        state = self.start_state(batch)
        graph = self.needs_graph(scored, bounds, recurrent)
        hiddens, keys = [], []
        for i, (a, b) in enumerate(bounds):
            if not recurrent:
                state = self.initial_state(B)
            elif self.cuts_gradient(i, len(bounds)):
                state = state.detach()
            with torch.set_grad_enabled(graph[i]):
                hidden, state = self._step(state, input_ids[:, a:b], None if mask is None else mask[:, a:b])
            hiddens.append(hidden[scored[:, a:b]])
            keys.append(flat_index[:, a:b][scored[:, a:b]])
        if recurrent and "reset" in batch:
            self._carried[self.training] = state.detach()
        return torch.cat(hiddens)[torch.cat(keys).argsort()]

    def forward(self, batch: dict, recurrent: bool = True) -> ModelOutput:
        """Logits at the scored positions; recurrent=False resets the memory every segment (an ablation)."""
        hidden = self.scored_hidden(batch, recurrent)
        return ModelOutput(self.backbone.head(hidden), batch["labels"][scored_positions(batch["labels"])])

    @torch.no_grad()
    def short_context_logprobs(
        self, batch: dict, out: ModelOutput, K: int | None = None, d: int | None = None
    ) -> Tensor:
        """log P(target) (N,) from each segment alone (memory reset to M_0 every segment), for LongCE; no grad.
        K and d (the sliding window of CausalLM) do not apply: the segment is the short context."""
        return head_logprobs(self.backbone.head, self.scored_hidden(batch, recurrent=False), out.targets)

    @torch.no_grad()
    def iter_logits(self, input_ids: Tensor) -> Iterator[Tensor]:
        """Logits (B, L_i, V) segment by segment with memory: one segment of activations at a time."""
        state = self.initial_state(len(input_ids))
        for a, b in self.segment_bounds(input_ids.shape[1]):
            hidden, state = self.run_segment(state, input_ids[:, a:b], None)
            yield self.backbone.head(hidden)

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, max_new_tokens: int, eos_id: int, attention_mask: Tensor | None = None
    ) -> list[list[int]]:
        """Greedy answers (B rows) at the last segment of the left-padded prompt (B, T), from its read memory."""
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        bounds = self.segment_bounds(input_ids.shape[1])
        state = self.initial_state(len(input_ids))
        for a, b in bounds[:-1]:
            _, state = self.run_segment(state, input_ids[:, a:b], mask[:, a:b])
        ids, seg_mask = input_ids[:, bounds[-1][0] :], mask[:, bounds[-1][0] :]
        out = [[] for _ in range(len(ids))]
        done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            hidden, _ = self.run_segment(state, ids, seg_mask, write=False)
            nxt = self.backbone.head(hidden[:, -1]).argmax(-1)  # (B,)
            for row in (~done).nonzero().flatten().tolist():
                out[row].append(int(nxt[row]))
            done |= nxt == eos_id
            if bool(done.all()):
                break
            ids, seg_mask = (
                torch.cat([ids, nxt[:, None]], 1),
                torch.cat([seg_mask, seg_mask.new_ones(len(ids), 1)], 1),
            )
        return out


def rows_with_tokens(input_ids: Tensor, mask: Tensor | None) -> Tensor:
    """(B,) True for the rows of a segment (B, L) with at least one real token."""
    if mask is None:
        return torch.ones(len(input_ids), dtype=torch.bool, device=input_ids.device)
    return mask.bool().any(1)


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def build_rmt(
    backbone: nn.Module,
    num_memory: int,
    segment_size: int,
    k2: int = -1,
    checkpoint_segments: bool = False,
    alibi_free_memory: bool = False,
    memory_scale: float = 1.0,
) -> RMT:
    """Hydra target of configs/model/rmt.yaml: `hydra.utils.instantiate(cfg.model, backbone=backbone)`."""
    return RMT(backbone, num_memory, segment_size, k2, checkpoint_segments, alibi_free_memory, memory_scale)
