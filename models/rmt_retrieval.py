"""RMT with self-retrieval, RMT-R (Kuratov et al. 2024, "In Search of Needles in a 11M Haystack", Sec. 4, Eq. 2).

RMT plus one module: every past memory state is kept, and before segment t each memory token of M_{t-1} queries
all of them with single-head cross-attention (pre-norms, residual, MLP, as in the reference implementation):

    Q = LN(M_{t-1}) W_Q,  K, V = LN([M_0 .. M_{t-1}]) W_K, W_V,  R_t = M_{t-1} + softmax(QK^T / sqrt(d)) V W_O
    R_t = R_t + MLP(LN(R_t))

and the backbone runs [M_{t-1}; R_t; X_t; M_{t-1}] (read memory 2m, write memory last). The bank holds H = LN(M) of
each state (normed once, when the state is made), so it grows as n x m x d; retrieval costs O(m x n m) per segment.
The projections move off the bank, exactly: q k^T = (q W_K) h^T + q b_K, and a shift per query leaves the softmax
as it is; the weights P sum to 1, so P (H W_V^T + b_V) = (P H) W_V^T + b_V. One attention pass then reads one
tensor, H, as both keys and values (where a 1M-token evaluation spends its time: bench/retrieval_floor.py).
Truncated backprop through time (k2 >= 0) detaches the bank with the memory, so no gradient crosses more than k2
transitions through retrieval either (the reference implementation refuses k2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config_errors import ConfigError
from models.memory import MemoryBank, MemoryState
from models.rmt import RMT


class MemoryRetrieval(nn.Module):
    """Single-head cross-attention of the memory (B, m, D) over a bank of past states (B, S, D), then an MLP."""

    def __init__(self, dim: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm_q, self.norm_kv, self.norm_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def bank_entry(self, memory: Tensor) -> Tensor:
        """What the bank stores of a state (B, m, D): LN(M), (B, m, D)."""
        return self.norm_kv(memory)

    def forward(self, memory: Tensor, bank: MemoryBank) -> Tensor:
        """Retrieved states R_t (B, m, D) from the bank's valid entries."""
        q = self.q_proj(self.norm_q(memory)) @ self.k_proj.weight  # (B, m, D): q W_K, scored against H
        h = bank.states[:, None]  # (B, 1, S, D): one head, keys = values = H
        read = F.scaled_dot_product_attention(q[:, None], h, h, attn_mask=bank.valid[:, None, None])  # P H
        r = memory + self.o_proj(self.v_proj(read[:, 0]))
        return r + self.mlp(self.norm_mlp(r))


class RMTRetrieval(RMT):
    """RMT whose read memory is [M_{t-1}; R_t], R_t retrieved from all past states [M_0 .. M_{t-1}]."""

    def __init__(
        self,
        backbone: nn.Module,
        num_memory: int,
        segment_size: int,
        k2: int = -1,
        checkpoint_segments: bool = False,
        retrieval_mlp_ratio: int = 4,
        alibi_free_memory: bool = False,
        memory_scale: float = 1.0,
    ):
        if num_memory < 1:
            raise ConfigError(f"RMT-R retrieves memory states, so num_memory must be >= 1, got {num_memory}")
        super().__init__(
            backbone, num_memory, segment_size, k2, checkpoint_segments, alibi_free_memory, memory_scale
        )
        self.retrieval = MemoryRetrieval(backbone.hidden_size, retrieval_mlp_ratio).to(self.memory.device)
        self.latest_only = False  # retrieving_latest(): the bank holds M_{t-1} alone

    @contextmanager
    def retrieving_latest(self) -> Iterator[None]:
        """Within it the bank holds the latest state M_{t-1} alone, the one state RMT reads: an ablation of
        retrieval over past states (evaluate.py eval.babilong.memory=latest)."""
        self.latest_only = True
        try:
            yield
        finally:
            self.latest_only = False

    def _entry(self, memory: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Bank entry of a state (B, m, D) for the rows where valid (B,)."""
        return self.retrieval.bank_entry(memory), valid[:, None].expand(-1, memory.shape[1])

    def initial_state(self, batch_size: int) -> MemoryState:
        return self.latest_state(super().initial_state(batch_size).memory)

    def latest_state(self, memory: Tensor) -> MemoryState:
        """The state of memory (B, m, D), its bank holding that state alone."""
        valid = torch.ones(memory.shape[0], dtype=torch.bool, device=memory.device)
        return MemoryState(memory, MemoryBank.start(*self._entry(memory, valid)))

    def read_memory(self, state: MemoryState) -> Tensor:
        return torch.cat([state.memory, self.retrieval(state.memory, state.bank)], 1)  # (B, 2m, D)

    def next_state(self, state: MemoryState, new_memory: Tensor, has_tokens: Tensor) -> MemoryState:
        memory = super().next_state(state, new_memory, has_tokens).memory
        if self.latest_only:  # a row without tokens kept its memory, so its one entry stays as it was
            return self.latest_state(memory)
        return MemoryState(memory, state.bank.append(*self._entry(memory, has_tokens)))

    def restart_rows(self, state: MemoryState, rows: Tensor) -> MemoryState:
        memory = super().restart_rows(state, rows).memory
        if self.latest_only:
            return self.latest_state(memory)
        bank = state.bank.invalidate(rows).append(*self._entry(memory, rows)).compact()
        return MemoryState(memory, bank)


def build_rmt_r(
    backbone: nn.Module,
    num_memory: int,
    segment_size: int,
    k2: int = -1,
    checkpoint_segments: bool = False,
    retrieval_mlp_ratio: int = 4,
    alibi_free_memory: bool = False,
    memory_scale: float = 1.0,
) -> RMTRetrieval:
    """Hydra target of configs/model/rmt_r.yaml: `hydra.utils.instantiate(cfg.model, backbone=backbone)`."""
    return RMTRetrieval(
        backbone,
        num_memory,
        segment_size,
        k2,
        checkpoint_segments,
        retrieval_mlp_ratio,
        alibi_free_memory,
        memory_scale,
    )
