"""Evaluator-facing functions over any task model's `iter_logits` stream (bounded memory for any length)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


@torch.no_grad()
def predict_fn(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """`predict(input_ids (B, T)) -> argmax next-token ids (B, T)`, streamed chunk by chunk."""

    def predict(input_ids: Tensor) -> Tensor:
        return torch.cat([logits.argmax(-1) for logits in model.iter_logits(input_ids)], dim=1)

    return predict


@torch.no_grad()
def token_logprobs(model: nn.Module, input_ids: Tensor) -> Tensor:
    """log P(input_ids[:, t] | input_ids[:, <t]) as (B, T); index 0 (nothing precedes it) is NaN."""
    out, start = [torch.full_like(input_ids[:, :1], float("nan"), dtype=torch.float32)], 0
    for logits in model.iter_logits(input_ids):
        n = logits.shape[1]
        targets = input_ids[:, start + 1 : start + n + 1]
        lp = torch.log_softmax(logits[:, : targets.shape[1]].float(), -1)
        out.append(lp.gather(-1, targets[..., None])[..., 0])
        start += n
    return torch.cat(out, dim=1)
