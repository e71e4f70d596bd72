"""Recurrent-memory state of RMT / RMT-R / ARMT: the current memory M_{t-1}, for RMT-R the bank of past states,
for ARMT the per-layer associative memory.

Small typed objects instead of tuples of tensors (see CONVENTIONS: "Memory state is a small typed object").
The bank keeps what retrieval needs of every past state [M_0 .. M_{t-1}]: the normed states (B, S, D), S = t*m,
that its keys and values are projections of, plus a validity mask (B, S) (False for entries of rows that were
padding in that segment or that restarted).
The associative memory has a fixed size, however much was written (models/associative.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class MemoryBank:
    """Normed past states (B, capacity, D), what RMT-R's keys and values are projected from; the first `size` are filled.

    With gradients on, `append` builds new tensors (autograd needs the old ones unchanged); without gradients it
    writes in place into a buffer that doubles when full, so streaming n segments costs O(n) copies, not O(n^2).
    """

    states_buffer: Tensor  # (B, capacity, D)
    valid_buffer: Tensor  # (B, capacity) bool
    size: int

    @classmethod
    def start(cls, states: Tensor, valid: Tensor) -> MemoryBank:
        """A bank holding one memory state: states (B, m, D), valid (B, m)."""
        return cls(states, valid, states.shape[1])

    @property
    def states(self) -> Tensor:  # (B, S, D)
        return self.states_buffer[:, : self.size]

    @property
    def valid(self) -> Tensor:  # (B, S)
        return self.valid_buffer[:, : self.size]

    def append(self, states: Tensor, valid: Tensor) -> MemoryBank:
        """The bank with one more memory state appended: states (B, m, D), valid (B, m)."""
        n = states.shape[1]
        if torch.is_grad_enabled():
            return MemoryBank(
                torch.cat([self.states, states], 1), torch.cat([self.valid, valid], 1), self.size + n
            )
        bank = self if self.size + n <= self.states_buffer.shape[1] else self._grown(2 * (self.size + n))
        bank.states_buffer[:, bank.size : bank.size + n] = states
        bank.valid_buffer[:, bank.size : bank.size + n] = valid
        bank.size += n
        return bank

    def _grown(self, capacity: int) -> MemoryBank:
        def grow(t: Tensor) -> Tensor:
            new = t.new_zeros((t.shape[0], capacity, *t.shape[2:]))
            new[:, : self.size] = t[:, : self.size]
            return new

        return MemoryBank(grow(self.states_buffer), grow(self.valid_buffer), self.size)

    def invalidate(self, rows: Tensor) -> MemoryBank:
        """The bank with every entry of the rows where `rows` (B,) is True marked invalid."""
        return MemoryBank(self.states, self.valid & ~rows[:, None], self.size)

    def compact(self) -> MemoryBank:
        """The bank without the entries that no row can use any more (invalid in every row)."""
        keep = self.valid.any(0)  # (S,)
        if bool(keep.all()):
            return self
        return MemoryBank(self.states[:, keep], self.valid[:, keep], int(keep.sum()))

    def detach(self) -> MemoryBank:
        return MemoryBank(self.states.detach(), self.valid, self.size)


@dataclass
class AssociativeMemory:
    """ARMT's memory of every layer: matrices A (B, n_layers, F, D) and normalisers z (B, n_layers, F), float32."""

    A: Tensor
    z: Tensor

    @classmethod
    def empty(cls, batch_size: int, n_layers: int, n_features: int, dim: int, device) -> AssociativeMemory:
        """Nothing written: A = 0, z = 0."""
        return cls(
            torch.zeros(batch_size, n_layers, n_features, dim, device=device),
            torch.zeros(batch_size, n_layers, n_features, device=device),
        )

    def where(self, rows: Tensor, other: AssociativeMemory) -> AssociativeMemory:
        """This memory in the rows where `rows` (B,) is True, `other` elsewhere."""
        return AssociativeMemory(
            torch.where(rows[:, None, None, None], self.A, other.A),
            torch.where(rows[:, None, None], self.z, other.z),
        )

    def detach(self) -> AssociativeMemory:
        return AssociativeMemory(self.A.detach(), self.z.detach())


@dataclass
class MemoryState:
    """memory: M_{t-1} (B, m, D), the memory tokens carried to the next segment (ARMT: possibly none, m = 0);
    bank: RMT-R's past states or None; associative: ARMT's per-layer associative memory or None."""

    memory: Tensor
    bank: MemoryBank | None = None
    associative: AssociativeMemory | None = None

    def detach(self) -> MemoryState:
        """The same state cut from the autograd graph (truncated backprop through time)."""
        return MemoryState(
            self.memory.detach(),
            None if self.bank is None else self.bank.detach(),
            None if self.associative is None else self.associative.detach(),
        )

    @property
    def batch_size(self) -> int:
        return self.memory.shape[0]
