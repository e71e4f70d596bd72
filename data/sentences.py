"""Background text as tokenized sentences: split with `sentencex`, tokenize once, cache, memory-map.

BABILong hides task facts between sentences of background text, so the background of a split is kept as one flat
token array plus sentence offsets; building a haystack is then index arithmetic. Every sentence (and every fact,
question and answer) is tokenized on its own with `encode_pieces`, so any concatenation of pieces decodes to the
pieces joined by spaces and each fact appears in a haystack as exactly its own tokens.
Held-out splits drop every sentence that also occurs in the training split ("Thank you." is in many speeches), so
evaluation background never shares a sentence with training background.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import sentencex

from data.corpus import SPLITS, Corpus, default_cache_dir
from data.tokenizer import Tokenizer


def split_sentences(text: str, language: str = "en") -> list[str]:
    """Sentences of `text` (whitespace-stripped; paragraph breaks and empty pieces dropped)."""
    return [s for s in (piece.strip() for piece in sentencex.segment(language, text)) if s]


def encode_pieces(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Tokenize texts so that concatenated token lists decode to the texts joined by single spaces.

    SentencePiece (and HF Llama-style) tokenizers add a word-start marker to each text; byte-level BPE (GPT-2)
    does not, so there each text gets a leading space.
    """
    glued = tokenizer.decode(tokenizer.encode("a") + tokenizer.encode("b")).strip()
    prefix = "" if glued == "a b" else " "
    return tokenizer.encode_batch([prefix + t for t in texts])


@dataclass
class SentenceStore:
    """Sentences of one split in document order: sentence i is `tokens[offsets[i]:offsets[i+1]]`."""

    tokens: np.ndarray  # (N,) uint32
    offsets: np.ndarray  # (S + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def sentence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def keys(self) -> set[bytes]:
        """Each sentence's token bytes, to compare sentences across stores."""
        return {self.sentence(i).tobytes() for i in range(len(self))}

    def without(self, banned: set[bytes]) -> SentenceStore:
        """A copy without the sentences whose token bytes are in `banned`."""
        keep = [i for i in range(len(self)) if self.sentence(i).tobytes() not in banned]
        if len(keep) == len(self):
            return self
        pieces = [self.sentence(i) for i in keep]
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
        return SentenceStore(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def tokenize_sentences(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | Path | None = None, batch_docs: int = 16
) -> dict[str, SentenceStore]:
    """Sentence stores of every split, cached next to the corpus token cache (keyed by corpus and tokenizer
    fingerprints and the sentencex version). Held-out splits exclude sentences that occur in "train"."""
    key = f"{corpus.fingerprint}-{tokenizer.fingerprint}"
    root = Path(cache_dir or default_cache_dir()) / "tokens" / key / f"sentences-{version('sentencex')}"
    stores = {}
    for split in SPLITS:
        tok_file, off_file = root / f"{split}.u32", root / f"{split}.json"
        if not off_file.exists():
            _write_split(corpus.splits[split], tokenizer, tok_file, off_file, batch_docs, split)
        offsets = np.asarray(json.loads(off_file.read_text()), dtype=np.int64)
        n = int(offsets[-1])
        tokens = np.memmap(tok_file, dtype=np.uint32, mode="r", shape=(n,)) if n else np.zeros(0, np.uint32)
        stores[split] = SentenceStore(tokens, offsets)
    train_keys = stores["train"].keys()
    return {split: s if split == "train" else s.without(train_keys) for split, s in stores.items()}


def _write_split(
    docs, tokenizer: Tokenizer, tok_file: Path, off_file: Path, batch_docs: int, split: str
) -> None:
    """Write tokens, then offsets, each through a temporary name + rename, so a crash leaves no half cache."""
    from rich.progress import Progress

    tok_file.parent.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    tmp = tok_file.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f, Progress(transient=True) as progress:
        task = progress.add_task(f"splitting and tokenizing {split} sentences", total=len(docs))
        for i in range(0, len(docs), batch_docs):
            sentences = [s for d in docs[i : i + batch_docs] for s in split_sentences(d.text)]
            for ids in encode_pieces(tokenizer, sentences):
                np.asarray(ids, dtype=np.uint32).tofile(f)
                offsets.append(offsets[-1] + len(ids))
            progress.advance(task, len(docs[i : i + batch_docs]))
    os.replace(tmp, tok_file)
    off_tmp = off_file.with_suffix(f".tmp{os.getpid()}")
    off_tmp.write_text(json.dumps(offsets))
    os.replace(off_tmp, off_file)
