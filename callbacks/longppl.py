"""LongPPL: perplexity over the key tokens that need long context (Fang et al. 2024, arXiv:2410.23771).

LSD(x_j) = log P(x_j | x_<j) - log P(x_j | short context) and LCL(x_j) = log P(x_j | x_<j), both under an
evaluator model; x_j is a key token when LSD > alpha and LCL > beta. LongPPL = exp(mean NLL of the evaluated model
over the key tokens).

Short contexts use the paper's sliding window (Appendix A.1, Eq. 8): token j lies in block k = j // d; when
k*d >= K its short context is x_{kd-K} .. x_{j-1}, so one forward over the window x_{kd-K} .. x_{kd+d-2}
(K + d - 1 tokens) scores all d tokens of block k. Tokens with k*d < K have no short context (LSD = 0: never key).
All windows have the same length (the last one is right-padded, harmless for a causal model) and are stacked
into batches, so the short-context pass costs ceil(#windows / batch_size) forwards.

Alignment: every per-token tensor has one value per input token; index j scores x_j given what precedes it.
Index 0 has no prediction: its log-prob is NaN and it is never a key token.

`logits_fn(input_ids (B, T)) -> logits (B, T, V)` must be causal (position t sees inputs <= t only) with positions
counted from the start of each row, like a plain decoder-only LM forward.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LongPPLResult:
    """LongPPL over key tokens, PPL over every predicted token (indices 1..T-1), and the key-token mask (T,)."""

    longppl: float  # NaN when there is no key token
    ppl: float
    n_key: int
    n_tokens: int  # tokens with a prediction: T - 1
    key_mask: torch.Tensor  # (T,) bool


def _check_window(K: int, d: int, batch_size: int) -> None:
    if K < 1 or d < 1 or batch_size < 1:
        raise ValueError(
            f"need K >= 1, d >= 1 and batch_size >= 1, got K={K}, d={d}, batch_size={batch_size}"
        )


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.dtype != torch.long or tokens.numel() < 2:
        raise ValueError(
            f"tokens must be a 1-D LongTensor of at least 2 tokens, got shape {tuple(tokens.shape)} "
            f"dtype {tokens.dtype}; pass one document at a time (use sliding_window_short_logprobs for batches)"
        )


def _call_logits(logits_fn: LogitsFn, input_ids: torch.Tensor) -> torch.Tensor:
    logits = logits_fn(input_ids)
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits_fn must map input_ids {tuple(input_ids.shape)} to logits (B, T, V), got {tuple(logits.shape)}"
        )
    return logits


def _gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target], in float32: (..., V), (...) -> (...)."""
    logits = logits.float()
    return logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)


def first_short_index(K: int, d: int) -> int:
    """Index of the first token with a short context: the first block start k*d >= K."""
    return -(-K // d) * d


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token under the logits of the previous position; keeps gradient.

    logits (..., T, V), tokens (..., T) -> (..., T) float32, index 0 NaN.
    """
    predicted = _gather_logprobs(logits[..., :-1, :], tokens[..., 1:])  # (..., T-1)
    first = predicted.new_full((*predicted.shape[:-1], 1), float("nan"))
    return torch.cat([first, predicted], dim=-1)


@torch.no_grad()
def full_context_logprobs(logits_fn: LogitsFn, tokens: torch.Tensor) -> torch.Tensor:
    """log P(x_j | x_<j) from one forward over the whole text: tokens (T,) -> (T,), index 0 NaN."""
    _check_tokens(tokens)
    return token_logprobs(_call_logits(logits_fn, tokens[None]), tokens[None])[0]


@dataclass(frozen=True)
class ShortWindows:
    """The sliding windows of a padded batch: window w (K + d - 1 tokens) scores the d tokens `targets[w]` from
    its last d positions; `scatter` puts one value per target back at its (row, position) of the batch."""

    windows: torch.Tensor  # (W, K + d - 1)
    targets: torch.Tensor  # (W, d)
    rows: list[tuple[int, torch.Tensor]]  # per row with windows: (row, scored positions (n - start,))
    n_windows: list[int]  # windows per entry of `rows`
    shape: tuple[int, int]  # (B, T) of the batch

    def score(self, last_logits_fn: LogitsFn, batch_size: int) -> torch.Tensor:
        """Log-probs (W, d) of the targets; last_logits_fn(windows (b, K+d-1)) -> logits (b, d, V) at the
        windows' last d positions, called on `batch_size` windows at a time."""
        if not len(self.windows):
            return self.targets.new_zeros(self.targets.shape, dtype=torch.float32)
        return torch.cat(
            [
                _gather_logprobs(last_logits_fn(w), t)  # (b, d)
                for w, t in zip(self.windows.split(batch_size), self.targets.split(batch_size), strict=True)
            ]
        )

    def scatter(self, block_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W, d) values -> short (B, T) float32, NaN where there is no short context, and has_short (B, T)."""
        device = self.windows.device
        short = torch.full(self.shape, float("nan"), device=device)
        has_short = torch.zeros(self.shape, dtype=torch.bool, device=device)
        for (row, positions), blocks in zip(self.rows, block_logprobs.split(self.n_windows), strict=True):
            short[row, positions] = blocks.flatten()[: positions.numel()].float()
            has_short[row, positions] = True
        return short, has_short


def short_context_windows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, K: int, d: int
) -> ShortWindows:
    """The windows of Eq. 8 for every row of a padded batch, all rows stacked.

    input_ids (B, T); attention_mask (B, T), True/1 on real tokens (any padding side; None: no padding).
    Each row's real tokens, in order, form its text; padding never enters a window.
    """
    _check_window(K, d, 1)
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"input_ids must be a (B, T) LongTensor, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    start, window_len = first_short_index(K, d), K + d - 1
    windows, targets, rows = [], [], []  # per row: (n_blocks, K+d-1), (n_blocks, d), (row, positions)
    for row in range(input_ids.shape[0]):
        positions = mask[row].nonzero()[:, 0]  # (n,)
        n = positions.numel()
        if n <= start:
            continue
        n_blocks = -(-(n - start) // d)
        text = F.pad(input_ids[row, positions], (0, start + n_blocks * d - n))
        windows.append(text[start - K :].unfold(0, window_len, d)[:n_blocks])
        targets.append(text[start : start + n_blocks * d].view(n_blocks, d))
        rows.append((row, positions[start:]))
    empty = input_ids.new_zeros(0, window_len), input_ids.new_zeros(0, d)
    return ShortWindows(
        windows=torch.cat(windows) if windows else empty[0],
        targets=torch.cat(targets) if targets else empty[1],
        rows=rows,
        n_windows=[len(w) for w in windows],
        shape=tuple(input_ids.shape),
    )


@torch.no_grad()
def sliding_window_short_logprobs(
    logits_fn: LogitsFn,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    K: int,
    d: int,
    batch_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Short-context log-probs of a padded batch, the windows of all rows stacked into shared forwards.

    input_ids (B, T); attention_mask (B, T), True/1 on real tokens (any padding side; None: no padding).
    Each row's real tokens, in order, form its text; padding never enters a window.
    Returns short_logprobs (B, T) float32, NaN where there is no short context, and has_short (B, T) bool.
    """
    _check_window(K, d, batch_size)
    windows = short_context_windows(input_ids, attention_mask, K, d)
    return windows.scatter(windows.score(lambda w: _call_logits(logits_fn, w)[:, K - 1 :], batch_size))


def short_context_logprobs(
    logits_fn: LogitsFn, tokens: torch.Tensor, K: int, d: int, batch_size: int = 8
) -> torch.Tensor:
    """log P(x_j | short context) for one text: tokens (T,) -> (T,) float32, index 0 NaN.

    Where there is no short context (j < first_short_index(K, d)) the full-context log-prob is returned,
    from one extra forward over that prefix only.
    """
    _check_tokens(tokens)
    short, _ = sliding_window_short_logprobs(logits_fn, tokens[None], None, K, d, batch_size)
    prefix = min(tokens.numel(), first_short_index(K, d))
    if prefix > 1:
        short[0, :prefix] = full_context_logprobs(logits_fn, tokens[:prefix])
    return short[0]


def key_token_mask(
    evaluator_logits_fn: LogitsFn,
    tokens: torch.Tensor,
    K: int = 4096,
    d: int = 1024,
    alpha: float = 2.0,
    beta: float = -2.0,
    batch_size: int = 8,
) -> torch.Tensor:
    """Key tokens under the evaluator: has a short context, LSD > alpha and LCL > beta. tokens (T,) -> (T,) bool."""
    long = full_context_logprobs(evaluator_logits_fn, tokens)  # (T,) LCL
    short, has_short = sliding_window_short_logprobs(
        evaluator_logits_fn, tokens[None], None, K, d, batch_size
    )
    return has_short[0] & (long - short[0] > alpha) & (long > beta)


def longppl_from_logprobs(logprobs: torch.Tensor, key_mask: torch.Tensor) -> LongPPLResult:
    """Score the evaluated model from its full-context log-probs (T,) (index 0 NaN) and a key mask (T,)."""
    if logprobs.dim() != 1 or logprobs.shape != key_mask.shape or key_mask.dtype != torch.bool:
        raise ValueError(
            f"need 1-D logprobs and a bool key_mask of the same shape, got {tuple(logprobs.shape)} and "
            f"{tuple(key_mask.shape)} {key_mask.dtype}"
        )
    if key_mask[0]:
        raise ValueError("key_mask[0] is True but token 0 has no prediction; set key_mask[0] = False")
    nll = -logprobs[1:].double()
    key_nll = -logprobs[key_mask].double()
    n_key = key_nll.numel()
    return LongPPLResult(
        longppl=key_nll.mean().exp().item() if n_key else float("nan"),
        ppl=nll.mean().exp().item(),
        n_key=n_key,
        n_tokens=nll.numel(),
        key_mask=key_mask,
    )


def longppl(
    logits_fn: LogitsFn | None,
    evaluator_logits_fn: LogitsFn | None,
    tokens: torch.Tensor,
    K: int = 4096,
    d: int = 1024,
    alpha: float = 2.0,
    beta: float = -2.0,
    batch_size: int = 8,
    logprobs: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> LongPPLResult:
    """LongPPL of the evaluated model (logits_fn) with key tokens chosen by the evaluator; tokens (T,).

    Pass precomputed full-context `logprobs` (T,) (index 0 NaN) instead of logits_fn, e.g. from a streaming
    model, and/or a cached `key_mask` (T,) instead of evaluator_logits_fn. Both models share the tokenization;
    for different tokenizers map the key mask with key_spans / tokens_in_spans and call longppl_from_logprobs.
    """
    if key_mask is None:
        if evaluator_logits_fn is None:
            raise ValueError("pass evaluator_logits_fn or a precomputed key_mask")
        key_mask = key_token_mask(evaluator_logits_fn, tokens, K, d, alpha, beta, batch_size)
    if logprobs is None:
        if logits_fn is None:
            raise ValueError("pass logits_fn or precomputed full-context logprobs")
        logprobs = full_context_logprobs(logits_fn, tokens)
    return longppl_from_logprobs(logprobs, key_mask)


def key_spans(
    key_mask: torch.Tensor, offsets: torch.Tensor | Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Character spans [start, end) covered by key tokens, touching or overlapping spans merged, sorted.

    key_mask (T,) bool; offsets (T, 2) character offsets per token (HF fast tokenizers: `offset_mapping`).
    Tokens with an empty span (special tokens) contribute nothing.
    """
    offsets = torch.as_tensor(offsets, dtype=torch.long).reshape(-1, 2)
    if offsets.shape[0] != key_mask.numel():
        raise ValueError(f"offsets has {offsets.shape[0]} tokens but key_mask has {key_mask.numel()}")
    spans: list[tuple[int, int]] = []
    for start, end in sorted(offsets[key_mask.bool().cpu()].tolist()):
        if end <= start:
            continue
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def tokens_in_spans(
    offsets: torch.Tensor | Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """Which tokens lie entirely inside one of the merged spans from key_spans: offsets (T, 2) -> (T,) bool."""
    offsets = torch.as_tensor(offsets, dtype=torch.long).reshape(-1, 2)
    if not spans:
        return torch.zeros(offsets.shape[0], dtype=torch.bool)
    span_starts, span_ends = torch.tensor(spans, dtype=torch.long).T
    starts, ends = offsets[:, 0], offsets[:, 1]
    index = (
        torch.searchsorted(span_starts, starts, right=True) - 1
    )  # last span starting at or before the token
    inside = ends <= span_ends[index.clamp(min=0)]
    return (index >= 0) & inside & (ends > starts)
