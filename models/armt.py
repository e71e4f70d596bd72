"""Associative Recurrent Memory Transformer, ARMT (Rodkin, Kuratov, Bulatov, Burtsev 2024, arXiv 2407.04841).

RMT's segments (models/rmt.py: split from the right, padding, truncated BPTT with depth k2, streaming) with an
associative memory in every layer l: a matrix A_l (F x D) and a normaliser z_l (F), F = 2 nu d_mem
(models/associative.py). Segment t runs as

    [X_t; M] -> backbone, where before each layer l every position h adds  A_l^T phi(W_Q h) / (z_l^T phi(W_Q h))

and afterwards the write tokens' outputs of layer l, m_i (m, D), are written into A_l, z_l with the delta rule.
As in the paper and its reference code, the write tokens M are the same learned (m, D) parameter every segment and
nothing precedes the segment: all that passes between segments is A and z, O(n_layers x F x D) whatever the
length. `rmt_tokens=True` keeps RMT's token recurrence as well, [M_{t-1}; X_t; M_{t-1}] with the write outputs
carried, so that ARMT is exactly RMT plus the associative memory (with A = 0 it computes what RMT does).

The memory is read and written through the backbone's per-layer residual hook (`models.llama.ResidualHook`), which
only our Llama has: a Hugging Face model is refused (a Hugging Face Llama checkpoint loads into our Llama).
Truncated BPTT detaches A and z with the memory, so no gradient crosses more than k2 transitions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.associative import LayerMemory
from models.config_errors import ConfigError
from models.llama import Llama
from models.memory import AssociativeMemory, MemoryState
from models.rmt import RMT, rows_with_tokens


class AssociativeHook:
    """The backbone's residual hook for one segment: before layer l every position reads (A_l, z_l); the outputs
    of each layer at the last `n_write` positions (the write tokens; 0: none, as when generating) are kept."""

    def __init__(self, layers: nn.ModuleList, memory: AssociativeMemory, n_write: int):
        self.layers, self.memory, self.n_write = layers, memory, n_write
        self.written: list[Tensor] = []  # per layer: its output at the write tokens (B, m, D)

    def __call__(self, layer: int, x: Tensor) -> Tensor:
        if layer > 0 and self.n_write:
            self.written.append(x[:, -self.n_write :])  # layer - 1's output
        if layer == len(self.layers):
            return x
        return x + self.layers[layer].read(self.memory.A[:, layer], self.memory.z[:, layer], x)

    def updated(self) -> AssociativeMemory:
        """A, z of every layer after writing this segment's write tokens."""
        new = [
            mem.write(self.memory.A[:, i], self.memory.z[:, i], m)
            for i, (mem, m) in enumerate(zip(self.layers, self.written, strict=True))
        ]
        return AssociativeMemory(torch.stack([A for A, _ in new], 1), torch.stack([z for _, z in new], 1))


class ARMT(RMT):
    """RMT with a delta-rule associative memory in every layer (module docstring)."""

    def __init__(
        self,
        backbone: nn.Module,
        num_memory: int,
        segment_size: int,
        k2: int = -1,
        checkpoint_segments: bool = False,
        d_mem: int = 32,
        nu: int = 3,
        rmt_tokens: bool = False,
        use_denom: bool = True,
        alibi_free_memory: bool = False,
    ):
        if not isinstance(backbone, Llama):
            raise ConfigError(
                f"ARMT reads and writes memory inside every layer through our Llama's per-layer residual hook; got "
                f"{type(backbone).__name__}. Use backbone=tiny|llama_83m|smollm2_135m (a Hugging Face Llama "
                "checkpoint loads into our Llama with backbone.weights=<hub id or folder>)."
            )
        if num_memory < 1:
            raise ConfigError(f"ARMT writes its memory tokens, so num_memory must be >= 1, got {num_memory}")
        if d_mem < 1 or nu < 1:
            raise ConfigError(f"d_mem and nu must be >= 1, got d_mem={d_mem}, nu={nu}")
        super().__init__(backbone, num_memory, segment_size, k2, checkpoint_segments, alibi_free_memory)
        self.rmt_tokens = rmt_tokens
        self.n_features = 2 * nu * d_mem
        self.layer_memories = nn.ModuleList(
            LayerMemory(backbone.hidden_size, d_mem, nu, use_denom) for _ in backbone.layers
        ).to(self.memory.device)

    def empty_associative(self, batch_size: int) -> AssociativeMemory:
        return AssociativeMemory.empty(
            batch_size,
            len(self.layer_memories),
            self.n_features,
            self.backbone.hidden_size,
            self.memory.device,
        )

    def initial_state(self, batch_size: int) -> MemoryState:
        """M_0 (rmt_tokens) or no carried tokens (B, 0, D), and an empty associative memory."""
        tokens = super().initial_state(batch_size).memory
        memory = tokens if self.rmt_tokens else tokens[:, :0]
        return MemoryState(memory, associative=self.empty_associative(batch_size))

    def write_memory(self, state: MemoryState) -> Tensor:
        return state.memory if self.rmt_tokens else self.memory.expand(state.batch_size, -1, -1)

    def next_state(self, state: MemoryState, new_memory: Tensor, has_tokens: Tensor) -> MemoryState:
        """The carried tokens; the associative memory is written by `run_segment`."""
        memory = super().next_state(state, new_memory, has_tokens).memory if self.rmt_tokens else state.memory
        return MemoryState(memory, associative=state.associative)

    def restart_rows(self, state: MemoryState, rows: Tensor) -> MemoryState:
        memory = super().restart_rows(state, rows).memory
        associative = self.empty_associative(state.batch_size).where(rows, state.associative)
        return MemoryState(memory, associative=associative)

    def run_segment(
        self, state: MemoryState, input_ids: Tensor, mask: Tensor | None, write: bool = True
    ) -> tuple[Tensor, MemoryState | None]:
        """RMT's segment with every layer reading A; then the write tokens' outputs are written into A, z (in the
        rows with real tokens)."""
        hook = AssociativeHook(self.layer_memories, state.associative, self.num_memory if write else 0)
        hidden, new = super().run_segment(state, input_ids, mask, write, residual_hook=hook)
        if new is None:
            return hidden, None
        associative = hook.updated().where(rows_with_tokens(input_ids, mask), state.associative)
        return hidden, MemoryState(new.memory, associative=associative)


def build_armt(
    backbone: nn.Module,
    num_memory: int,
    segment_size: int,
    k2: int = -1,
    checkpoint_segments: bool = False,
    d_mem: int = 32,
    nu: int = 3,
    rmt_tokens: bool = False,
    use_denom: bool = True,
    alibi_free_memory: bool = False,
) -> ARMT:
    """Hydra target of configs/model/armt.yaml: `hydra.utils.instantiate(cfg.model, backbone=backbone)`."""
    return ARMT(
        backbone,
        num_memory,
        segment_size,
        k2,
        checkpoint_segments,
        d_mem,
        nu,
        rmt_tokens,
        use_denom,
        alibi_free_memory,
    )
