"""RMT with self-retrieval, RMT-R (Kuratov et al. 2024, "In Search of Needles in a 11M Haystack", Sec. 4, Eq. 2).

RMT plus one module: every past memory state is kept, and before segment t each memory token of M_{t-1} queries
all of them with single-head cross-attention (pre-norms, residual, MLP, as in the reference implementation):

    Q = LN(M_{t-1}) W_Q,  K, V = LN([M_0 .. M_{t-1}]) W_K, W_V,  R_t = M_{t-1} + softmax(QK^T / sqrt(d)) V W_O
    R_t = R_t + MLP(LN(R_t))

and the backbone runs [M_{t-1}; R_t; X_t; M_{t-1}] (read memory 2m, write memory last). The bank holds each state
normalised once, H = LN([M_0 .. M_{t-1}]), and the projections move off it, exactly: with K = H W_K + b_K,
Q K^T = (Q W_K^T) H^T + Q b_K^T, the last term the same for every entry (the softmax drops it), and with
V = H W_V + b_V, softmax(.) V = (softmax(.) H) W_V + b_V (the weights sum to 1). So the bank is one (B, S, D) tensor read once per segment (one fused attention), not keys and values: half
the memory and the traffic of the retrieval, which is what 1M-token streams spend their time on. It grows as
n x m x d; retrieval costs O(m x n m) per segment. Truncated backprop through time (k2 >= 0) detaches the bank
with the memory, so no gradient crosses more than k2 transitions through retrieval either (the reference
implementation refuses k2).
"""

from __future__ import annotations

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

    def normalised(self, memory: Tensor) -> Tensor:
        """What the bank stores of a state (B, m, D): LN(M), its keys' and values' common input."""
        return self.norm_kv(memory)

    def folded_query(self, memory: Tensor) -> Tensor:
        """Q W_K^T (B, m, D): its dot product with LN(M_j) is q . k_j less q . b_K, the same for every j."""
        return self.q_proj(self.norm_q(memory)) @ self.k_proj.weight

    def attention(self, memory: Tensor, bank: MemoryBank) -> Tensor:
        """Attention probabilities (B, m, S) of each memory token over the bank's valid entries."""
        q = self.folded_query(memory)
        mask = q.new_zeros(bank.valid.shape).masked_fill_(~bank.valid, float("-inf"))[:, None, :]  # (B, 1, S)
        return torch.baddbmm(mask, q, bank.states.transpose(1, 2), alpha=q.shape[-1] ** -0.5).softmax(-1)

    def forward(self, memory: Tensor, bank: MemoryBank) -> Tensor:
        """Retrieved states R_t (B, m, D): softmax(Q K^T / sqrt(D)) V in one fused pass over the bank."""
        q = self.folded_query(memory)[:, None]  # (B, 1, m, D)
        states = bank.states[:, None].to(q.dtype)  # (B, 1, S, D); a no-op outside autocast
        mixed = F.scaled_dot_product_attention(q, states, states, attn_mask=bank.valid[:, None, None, :])
        r = memory + self.o_proj(self.v_proj(mixed[:, 0]))
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
    ):
        if num_memory < 1:
            raise ConfigError(f"RMT-R retrieves memory states, so num_memory must be >= 1, got {num_memory}")
        super().__init__(backbone, num_memory, segment_size, k2, checkpoint_segments, alibi_free_memory)
        self.retrieval = MemoryRetrieval(backbone.hidden_size, retrieval_mlp_ratio).to(self.memory.device)

    def _entry(self, memory: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Bank entry of a state (B, m, D) for the rows where valid (B,)."""
        return self.retrieval.normalised(memory), valid[:, None].expand(-1, memory.shape[1])

    def initial_state(self, batch_size: int) -> MemoryState:
        memory = super().initial_state(batch_size).memory
        valid = torch.ones(batch_size, dtype=torch.bool, device=memory.device)
        return MemoryState(memory, MemoryBank.start(*self._entry(memory, valid)))

    def read_memory(self, state: MemoryState) -> Tensor:
        return torch.cat([state.memory, self.retrieval(state.memory, state.bank)], 1)  # (B, 2m, D)

    def next_state(self, state: MemoryState, new_memory: Tensor, has_tokens: Tensor) -> MemoryState:
        memory = super().next_state(state, new_memory, has_tokens).memory
        return MemoryState(memory, state.bank.append(*self._entry(memory, has_tokens)))

    def restart_rows(self, state: MemoryState, rows: Tensor) -> MemoryState:
        memory = super().restart_rows(state, rows).memory
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
) -> RMTRetrieval:
    """Hydra target of configs/model/rmt_r.yaml: `hydra.utils.instantiate(cfg.model, backbone=backbone)`."""
    return RMTRetrieval(
        backbone, num_memory, segment_size, k2, checkpoint_segments, retrieval_mlp_ratio, alibi_free_memory
    )
