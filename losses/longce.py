"""LongCE: cross-entropy re-weighted by how much long context helps each token (Fang et al. 2024, Eq. 6-7).

LongCE = -(1/n) sum_i w_i log P(x_i | x_<i), w_i = min(exp(LSD(x_i)), gamma), n = number of scored (non-pad)
tokens. The weights come from the model being trained, without gradient: LSD(x_i) = log P(x_i | x_<i) -
log P(x_i | short context), short contexts from the sliding window of callbacks.longppl (K, d); tokens with no
short context (block start k*d < K) get weight 1. Unlike the reference implementation, padding is never scored.

Per-token tensors follow callbacks.longppl: one value per input token, index j scoring x_j, so a (B, T) batch
needs one batched no-grad pass over the windows of all rows on top of the training forward.

`LongCE` is the injected loss of the framework (`loss=longce`, like `loss=ce`): `loss(out, model, batch)` with
the N scored positions of `out` (padding is never among them). The short contexts come from the task model:
    model.short_context_logprobs(batch, out, K=None, d=None) -> (N,) float log-probs aligned with out.targets,
    no grad; NaN marks a target without a short context or whose short context is its full context (weight 1).
- CausalLM (plain LM): the sliding window above over each row, K tokens of context, blocks of d (defaults:
  K = d = a quarter of the training length). The block kd = K starts its window at the row's first token, so its
  short context is the full one (LSD = 0): it is not computed, so for K = d the extra no-grad pass runs about
  2(T - 2K) tokens per row of T instead of 2(T - K).
- Recurrent models (RMT, RMT-R, Llama-XL): the short context of a target is its own segment alone: the backbone
  run on each segment without memory (RMT: M_0 every segment) / without the KV cache (Llama-XL). K and d are
  ignored; the first segment of a fresh stream then has LSD = 0 (weight 1), like the first K tokens above.
"""

import torch
import torch.nn.functional as F
from torch import nn

from callbacks.longppl import LogitsFn, sliding_window_short_logprobs, token_logprobs
from models.config_errors import ConfigError
from models.outputs import ModelOutput

__all__ = [
    "LongCE",
    "longce_loss",
    "longce_loss_for_batch",
    "longce_weights",
    "sliding_window_short_logprobs",
]


def longce_weights(
    long_logprobs: torch.Tensor, short_logprobs: torch.Tensor, has_short: torch.Tensor, gamma: float = 5.0
) -> torch.Tensor:
    """min(exp(long - short), gamma) where has_short, else 1; no gradient. All inputs the same shape (...)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if not long_logprobs.shape == short_logprobs.shape == has_short.shape:
        raise ValueError(
            f"shapes differ: long {tuple(long_logprobs.shape)}, short {tuple(short_logprobs.shape)}, "
            f"has_short {tuple(has_short.shape)}"
        )
    with torch.no_grad():
        ratio = (long_logprobs.detach().float() - short_logprobs.float()).exp().clamp(max=gamma)
        return torch.where(has_short, ratio, torch.ones_like(ratio))


def longce_loss(logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-sum(w * logp * mask) / sum(mask): the weighted mean NLL over the n scored tokens (0 when n = 0).

    logprobs (...) with gradient, weights (...) without, mask (...) bool: True on tokens to score. Values
    outside the mask (NaN at index 0, padding) never reach the loss or its gradient.
    """
    if weights.requires_grad:
        raise ValueError("weights must carry no gradient; compute them with longce_weights")
    if not logprobs.shape == weights.shape == mask.shape:
        raise ValueError(
            f"shapes differ: logprobs {tuple(logprobs.shape)}, weights {tuple(weights.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    weighted = torch.where(mask, weights * logprobs, torch.zeros_like(logprobs))
    return -weighted.sum() / mask.sum().clamp(min=1)


def longce_loss_for_batch(
    logits_fn: LogitsFn,
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    attention_mask: torch.Tensor | None,
    K: int,
    d: int,
    gamma: float = 5.0,
    batch_size: int = 8,
) -> torch.Tensor:
    """LongCE of a (B, T) LM batch from its training-forward logits (B, T, V).

    Scores every real token whose previous position is also real (all predicted, non-pad tokens); the weights
    take one extra no-grad pass of logits_fn over the sliding windows of all rows. For another scoring mask
    (e.g. answer tokens only), compose token_logprobs, sliding_window_short_logprobs, longce_weights and
    longce_loss.
    """
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    scored = mask.clone()
    scored[:, 1:] &= mask[:, :-1]
    scored[:, 0] = False
    logprobs = token_logprobs(logits, input_ids)  # (B, T)
    short, has_short = sliding_window_short_logprobs(logits_fn, input_ids, mask, K, d, batch_size)
    return longce_loss(logprobs, longce_weights(logprobs, short, has_short, gamma), scored)


class LongCE(nn.Module):
    """The injected LongCE loss: `loss(out, model, batch) -> scalar`, interchangeable with losses.ce.CrossEntropy.

    gamma: weight cap (the paper: 5), >= 1 so that a token whose short context is its full context (LSD = 0,
    which the models leave uncomputed as NaN) keeps its weight min(exp(0), gamma) = 1. K, d: short context length
    and block size handed to `model.short_context_logprobs` (CausalLM uses them, None: its defaults; recurrent
    models use their segment instead).

    After each call, `logged` holds what the run logs beside train/loss (the LongCE value, not comparable with a
    CE run's): `ce`, the plain cross-entropy of the same tokens, and how the weights fell: their mean, and the
    shares of tokens up-weighted (long context helped: w > 1) and down-weighted (it hurt: w < 1).
    """

    def __init__(self, gamma: float = 5.0, K: int | None = None, d: int | None = None):
        super().__init__()
        if gamma < 1:
            raise ConfigError(
                f"LongCE gamma caps the up-weighting of long-context tokens and must be >= 1 (1: plain CE), got {gamma}"
            )
        self.gamma, self.K, self.d = gamma, K, d
        self.logged: dict[str, torch.Tensor] = {}

    def forward(self, out: ModelOutput, model: nn.Module, batch: dict) -> torch.Tensor:
        logprobs = -F.cross_entropy(out.logits.float(), out.targets, reduction="none")  # (N,)
        short = model.short_context_logprobs(batch, out, K=self.K, d=self.d)  # (N,) no grad, NaN: none
        if short.shape != logprobs.shape:
            raise ValueError(
                f"{type(model).__name__}.short_context_logprobs returned {tuple(short.shape)}; it must return one "
                f"log-prob per scored position, aligned with out.targets {tuple(logprobs.shape)}"
            )
        weights = longce_weights(logprobs, short, ~short.isnan(), self.gamma)
        self.logged = {
            "ce": -logprobs.detach().mean(),
            "longce_weight": weights.mean(),
            "longce_up": (weights > 1).float().mean(),
            "longce_down": (weights < 1).float().mean(),
        }
        return longce_loss(logprobs, weights, torch.ones_like(weights, dtype=torch.bool))
