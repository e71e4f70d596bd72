"""The plain causal LM task model: a backbone scored at the labelled positions, streamed with a sliding window."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from callbacks.longppl import short_context_windows
from models.config_errors import ConfigError
from models.outputs import ModelOutput, head_logprobs, scored_positions


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
            raise ConfigError(f"stride must be in (0, window={window}], got {stride}")

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
            yield self.backbone.head(self.backbone(input_ids=input_ids[:, start:end])[:, done - start :])
            done = end

    @torch.no_grad()
    def short_context_logprobs(
        self, batch: dict, out: ModelOutput, K: int | None = None, d: int | None = None
    ) -> Tensor:
        """log P(target | short context) (N,) at the scored positions of `out`, for LongCE; no grad.

        Short context: the sliding window of Fang et al. 2024 (App. A.1, Eq. 8) over each row's text (its real
        tokens, then the last one's target): a target at text index j, in block k = j // d, is predicted from
        text[kd - K : j] alone, one forward per window of K + d - 1 tokens, windows of all rows batched.
        K defaults to a quarter of the training length (`window`), d to K.
        NaN where the target has no short context (kd < K) or where it is the full context (kd = K: LSD = 0,
        not computed): LongCE gives both weight 1. Needs next-token labels (labels[:, t] == the next real input
        token) wherever both exist.
        """
        K = self.window // 4 if K is None else K
        d = K if d is None else d
        ids, labels = batch["input_ids"], batch["labels"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        text_ids, text_mask = _append_last_target(ids, labels, mask)  # (B, T+1)
        scored = scored_positions(labels)
        if not bool((mask & text_mask[:, 1:] & (text_ids[:, 1:] == labels))[scored].all()):
            raise ValueError(
                "short_context_logprobs needs next-token labels: at every scored position t, input t is real and "
                "labels[:, t] equals the next real input token (or ends the row)"
            )
        windows = short_context_windows(text_ids, text_mask, K, d, drop_full_context=True)

        def last_logprobs(w: Tensor, targets: Tensor) -> Tensor:  # (b, K+n-1), (b, n) -> (b, n)
            return head_logprobs(self.backbone.head, self.backbone(input_ids=w)[:, K - 1 :], targets)

        per_forward = max(1, ids.numel() // (K + d - 1))  # windows per forward: about one batch of tokens
        short, _ = windows.scatter(windows.score(last_logprobs, per_forward))  # (B, T+1), NaN: not computed
        return short[:, 1:][scored]

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


def _append_last_target(ids: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's text as (B, T+1) ids and mask: the real inputs, then the target of the last real one (if any)."""
    B, T = ids.shape
    last = T - 1 - mask.flip(1).long().argmax(1)  # (B,) last real position
    rows = torch.arange(B, device=ids.device)
    target = labels[rows, last]
    add = mask.any(1) & (target != -100)
    text_ids, text_mask = nn.functional.pad(ids, (0, 1)), nn.functional.pad(mask, (0, 1))
    text_ids[rows[add], last[add] + 1] = target[add]
    text_mask[rows[add], last[add] + 1] = True
    return text_ids, text_mask


def build_causal_lm(backbone: nn.Module, window: int = 1024, stride: int | None = None) -> CausalLM:
    return CausalLM(backbone, window=window, stride=stride)
