"""Language-modelling datamodules over a tokenized corpus.

Two training streams, both infinite and resumable (batch j is a pure function of (seed, j), so a resumed run
continues with exactly the batch it would have seen, and dataloader workers never repeat each other):
- shuffled: fixed-length chunks of the concatenated training documents, in a seeded permutation per epoch;
- ordered (Transformer-XL): each batch row is one continuous stream of whole documents; consecutive batches
  continue it. A document's last segment is right-padded, and the next batch starts a new document in that row
  with `reset[b] = True`, so a recurrent model drops its cache exactly at document boundaries.
Each document is `[bos] text [eos]`. Optionally (`repeat_share`) a share of the shuffled training rows are a span of
text (or of random tokens, `repeat_random`) repeated end to end: the dense copying signal a small model needs to
learn to copy (docs/forgetting_longppl.md, finding 2).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from data.corpus import Corpus, TokenizedSplit, tokenize_corpus
from data.heap import release_freed_memory
from data.tokenizer import Tokenizer
from models.config_errors import ConfigError


def with_specials(split: TokenizedSplit, bos: int, eos: int) -> list[np.ndarray]:
    """Documents as int64 arrays `[bos] tokens [eos]`."""
    return [np.concatenate([[bos], split.doc(i).astype(np.int64), [eos]]) for i in range(len(split))]


def lm_batch(chunks: np.ndarray) -> dict[str, torch.Tensor]:
    """(B, T+1) token chunks -> inputs (B, T) and next-token labels (B, T)."""
    chunks = torch.from_numpy(chunks)
    return {"input_ids": chunks[:, :-1].contiguous(), "labels": chunks[:, 1:].contiguous()}


class BatchStream(IterableDataset):
    """Infinite stream of ready batches from `make_batch(j)`.

    This process (rank r of R) yields its local batches k = start, start+1, ... as global batches j = k·R + r;
    dataloader worker w of W makes the k ≡ w (mod W), and the DataLoader interleaves them back in order.
    """

    def __init__(self, make_batch, start: int = 0, rank: int = 0, world_size: int = 1):
        self.make_batch, self.start, self.rank, self.world_size = make_batch, start, rank, world_size

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        k = self.start + wid
        while True:
            yield self.make_batch(k * self.world_size + self.rank)
            k += n


def repeat_spans(
    chunks: np.ndarray, share: float, pool: np.ndarray | None, rng: np.random.Generator, min_span: int = 16
) -> np.ndarray:
    """(B, T+1) chunks, each row with probability `share` replaced by a span of k tokens repeated end to end,
    k uniform in [min_span, (T+1) // 2]: every token past the first k is the token k back. The span is the row's own
    first k tokens of text, or (with a `pool` of token ids) k tokens drawn uniformly from it: random tokens leave
    nothing to predict but the copy, which is how a small model first learns to copy (docs/forgetting_longppl.md,
    finding 2)."""
    out = chunks.copy()
    longest = chunks.shape[1] // 2
    for b in np.flatnonzero(rng.random(len(chunks)) < share):
        k = rng.integers(min(min_span, longest), longest + 1)
        out[b] = np.resize(chunks[b, :k] if pool is None else rng.choice(pool, k), chunks.shape[1])
    return out


class ShuffledChunks:
    """Batch j of non-overlapping (T+1)-token chunks, reshuffled every pass over the corpus; `repeat_share` of
    the rows (drawn afresh for each batch) are a span of text, or of random tokens, repeated (`repeat_spans`)."""

    def __init__(
        self,
        docs: list[np.ndarray],
        seq_len: int,
        batch_size: int,
        seed: int,
        repeat_share: float = 0.0,
        repeat_random: bool = False,
    ):
        stream = np.concatenate(docs)
        n = (len(stream) - 1) // seq_len
        if n < batch_size:
            raise ConfigError(f"Corpus too small: {n} chunks of {seq_len} tokens < batch_size {batch_size}")
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed
        self.per_epoch, self.repeat_share = n // batch_size, repeat_share
        # the tokens a random repeated span draws from (only a stream with repeats needs them)
        self.pool = np.unique(stream) if repeat_random and repeat_share > 0 else None

    def __call__(self, j: int) -> dict[str, torch.Tensor]:
        epoch, k = divmod(j, self.per_epoch)
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.per_epoch * self.batch_size)
        starts = perm[k * self.batch_size : (k + 1) * self.batch_size] * self.seq_len
        chunks = np.stack([self.stream[s : s + self.seq_len + 1] for s in starts])
        if self.repeat_share > 0:
            chunks = repeat_spans(
                chunks, self.repeat_share, self.pool, np.random.default_rng([self.seed, j, 1])
            )
        return lm_batch(chunks)


class OrderedStreams:
    """Row b of batch j is segment j of row b's stream: its documents, in order, cut into (T+1)-token pieces."""

    def __init__(self, docs: list[np.ndarray], seq_len: int, batch_size: int, pad_id: int, seed: int):
        if len(docs) < batch_size:
            raise ConfigError(
                f"{len(docs)} documents cannot fill {batch_size} ordered streams; lower batch_size"
            )
        order = np.random.default_rng(seed).permutation(len(docs))
        rows: list[list[int]] = [[] for _ in range(batch_size)]
        sizes = np.zeros(batch_size, dtype=np.int64)
        for i in order:  # greedy balance: the next document goes to the shortest row
            b = int(sizes.argmin())
            rows[b].append(int(i))
            sizes[b] += len(docs[i])
        # Each row: the (doc, start) of every segment; a pass over its documents then repeats.
        self.segments = [[(i, s) for i in row for s in range(0, len(docs[i]) - 1, seq_len)] for row in rows]
        self.docs, self.seq_len, self.pad_id = docs, seq_len, pad_id

    def __call__(self, j: int) -> dict[str, torch.Tensor]:
        T = self.seq_len
        ids = np.full((len(self.segments), T + 1), self.pad_id, dtype=np.int64)
        labels = np.full((len(self.segments), T), -100, dtype=np.int64)
        reset = np.zeros(len(self.segments), dtype=bool)
        for b, segs in enumerate(self.segments):
            i, s = segs[j % len(segs)]
            piece = self.docs[i][s : s + T + 1]
            ids[b, : len(piece)] = piece
            labels[b, : len(piece) - 1] = piece[1:]
            reset[b] = s == 0
        mask = (labels != -100).astype(np.int64)
        mask[:, 0] = 1
        return {
            "input_ids": torch.from_numpy(ids[:, :-1]),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(mask),
            "reset": torch.from_numpy(reset),
        }


class FixedBatches(Dataset):
    """A finite, deterministic list of batches (validation)."""

    def __init__(self, make_batch, n: int):
        self.make_batch, self.n = make_batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int):
        return self.make_batch(j)


class LMDataModule(L.LightningDataModule):
    def __init__(
        self,
        tokenizer: Tokenizer,
        corpus: Corpus,
        seq_len: int = 1024,
        batch_size: int = 8,
        ordered: bool = False,
        val_batches: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str | None = None,
        repeat_share: float = 0.0,
        repeat_random: bool = False,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("val_batches", val_batches)):
            if value < 1:
                raise ConfigError(f"task.{name} must be >= 1, got {value}.")
        if num_workers < 0:
            raise ConfigError(
                f"task.num_workers must be >= 0 (0: load in the main process), got {num_workers}."
            )
        if not 0.0 <= repeat_share <= 1.0:
            raise ConfigError(
                f"task.repeat_share is a share of the training rows, in [0, 1]; got {repeat_share}."
            )
        if repeat_share > 0 and ordered:
            raise ConfigError(
                "task.repeat_share repeats spans inside shuffled rows; an ordered (recurrent) stream cannot take it: "
                "set task.repeat_share=0 or use a model with ordered_data false."
            )
        self.tokenizer, self.corpus = tokenizer, corpus
        self.repeat_share, self.repeat_random = repeat_share, repeat_random
        self.seq_len, self.batch_size, self.ordered = seq_len, batch_size, ordered
        self.val_batches, self.num_workers, self.seed, self.cache_dir = (
            val_batches,
            num_workers,
            seed,
            cache_dir,
        )
        self.splits: dict[str, list[np.ndarray]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            tok = self.tokenizer
            tokenized = tokenize_corpus(self.corpus, tok, self.cache_dir)
            self.splits = {k: with_specials(v, tok.bos_id, tok.eos_id) for k, v in tokenized.items()}

    def make_stream(self, split: str, seed: int):
        docs = self.splits[split]
        if self.ordered:
            return OrderedStreams(docs, self.seq_len, self.batch_size, self.tokenizer.pad_id, seed)
        repeat_share = self.repeat_share if split == "train" else 0.0  # validation and test stay plain text
        return ShuffledChunks(docs, self.seq_len, self.batch_size, seed, repeat_share, self.repeat_random)

    def consumed_batches(self) -> int:
        """Training batches already used (restored from the checkpoint on resume)."""
        trainer = self.trainer
        return trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0

    def _loader(self, dataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=False,
            worker_init_fn=release_freed_memory,
        )

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        rank, world = (t.global_rank, t.world_size) if t is not None else (0, 1)
        stream = BatchStream(self.make_stream("train", self.seed), self.consumed_batches(), rank, world)
        return self._loader(stream)

    def val_dataloader(self) -> DataLoader:
        return self._loader(FixedBatches(self.make_stream("validation", seed=1), self.val_batches))

    def test_dataloader(self) -> DataLoader:
        return self._loader(FixedBatches(self.make_stream("test", seed=2), self.val_batches))


def build_lm_datamodule(tokenizer: Tokenizer, corpus: Corpus, **kwargs) -> LMDataModule:
    return LMDataModule(tokenizer, corpus, **kwargs)
