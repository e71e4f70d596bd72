"""Cross-entropy over the scored positions: mean over the N tokens a model scored (padding never counts)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from models.outputs import ModelOutput


class CrossEntropy(nn.Module):
    def forward(self, out: ModelOutput, model: nn.Module, batch: dict) -> Tensor:
        return F.cross_entropy(out.logits.float(), out.targets)
