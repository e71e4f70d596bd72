"""The plain causal LM task model: a backbone scored at the labelled positions, streamed with a sliding window."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from models.outputs import ModelOutput, scored_positions


class CausalLM(nn.Module):
    """Backbone + LM head applied only where `labels != -100` (the vocabulary costs nothing elsewhere).

    window: longest input the backbone sees at once when streaming (its training length); stride: new tokens per
    further window, so every token after the first window has at least `window - stride` tokens of context.
    """

    def __init__(self, backbone: nn.Module, window: int = 1024, stride: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.window = window
        self.stride = stride or window // 2
        if not 0 < self.stride <= window:
            raise ValueError(f"stride must be in (0, window={window}], got {stride}")

    def forward(self, batch: dict) -> ModelOutput:
        hidden = self.backbone(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
        scored = scored_positions(batch["labels"])
        return ModelOutput(self.backbone.head(hidden[scored]), batch["labels"][scored])

    @torch.no_grad()
    def iter_logits(self, input_ids: Tensor) -> Iterator[Tensor]:
        """Logits (B, T_i, V) chunk by chunk: the first window whole, then `stride` new positions per window."""
        T = input_ids.shape[1]
        done = 0
        while done < T:
            end = min(T, self.window if done == 0 else done + self.stride)
            start = max(0, end - self.window)
            yield self.backbone.head(self.backbone(input_ids=input_ids[:, start:end]))[:, done - start :]
            done = end

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, eos_id: int) -> list[list[int]]:
        """Greedy continuation of each prompt row (B, T) until EOS or `max_new_tokens`."""
        out, ids = [[] for _ in range(len(input_ids))], input_ids
        done = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = self.backbone.head(self.backbone(input_ids=ids[:, -self.window :])[:, -1]).argmax(-1)
            for b in (~done).nonzero().flatten().tolist():
                out[b].append(int(nxt[b]))
            done |= nxt == eos_id
            if done.all():
                break
            ids = torch.cat([ids, nxt[:, None]], 1)
        return out


def build_causal_lm(backbone: nn.Module, window: int = 1024, stride: int | None = None) -> CausalLM:
    return CausalLM(backbone, window=window, stride=stride)
