"""What every task model returns: logits at the scored positions only (the loss is applied elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class ModelOutput:
    """logits (N, V) and targets (N,) at the N scored positions `(batch["labels"] != -100).nonzero()`, row-major."""

    logits: Tensor
    targets: Tensor


def scored_positions(labels: Tensor) -> Tensor:
    """Bool mask (B, T) of the positions a model must score."""
    return labels != -100


def target_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log P(target) (N,) in float32 from logits (N, V) and targets (N,)."""
    return logits.float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
