"""Tokenizers behind one small interface.

Default: the Llama-style 32000-piece SentencePiece model shipped inside the `mistral-common` wheel
(`mistral_common/data/tokenizer.model.v1`, Apache-2.0). Alternative: any Hugging Face tokenizer by name or
local path (`tokenizer=hf tokenizer.name=gpt2`), the tokenizer inside a GGUF file, or a BPE vocabulary trained on the
corpus itself on first use (`tokenizer=bpe`: small vocabularies make tiny models several times faster on a CPU,
where the output layer is most of a step). Special-token ids are always read from the tokenizer, never hard-coded.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path

import numpy as np

from models.config_errors import ConfigError, MissingFileError, MissingPackageError

log = logging.getLogger(__name__)


class Tokenizer:
    """Text <-> token ids with `bos_id`, `eos_id`, `pad_id` (pad falls back to eos) and `vocab_size`."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in `text`."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """Stable id of the vocabulary, used as a cache key."""
        probe = self.encode("The fingerprint of a tokenizer: 1790, Washington; naïve café.")
        return hashlib.sha1(f"{self.name}|{self.vocab_size}|{probe}".encode()).hexdigest()[:12]


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        model_file = Path(model_file)
        if not model_file.is_file():
            raise MissingFileError(f"SentencePiece model not found: {model_file}")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.name = model_file.name
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=1)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        proto = self.sp.encode(text, return_type="proto")
        pieces = proto.pieces
        # SentencePiece offsets are in bytes of the UTF-8 text; convert to character offsets.
        byte_to_char = np.cumsum([0] + [len(c.encode()) for c in text])
        char_of = {int(b): i for i, b in enumerate(byte_to_char)}
        spans = [(char_of.get(p.begin, 0), char_of.get(p.end, len(text))) for p in pieces]
        return [p.id for p in pieces], spans

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(list(ids))


class HFTokenizer(Tokenizer):
    """Any Hugging Face tokenizer (`AutoTokenizer`) by hub name or local path, or from a GGUF file."""

    def __init__(self, name: str, gguf_file: str | None = None):
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.tok = AutoTokenizer.from_pretrained(name, **kwargs)
        self.name = f"{name}/{gguf_file}" if gguf_file else name
        self.vocab_size = len(self.tok)
        bos, eos = self.tok.bos_token_id, self.tok.eos_token_id
        if eos is None:
            raise ConfigError(f"Tokenizer {name!r} defines no EOS token; pick a tokenizer with one.")
        self.eos_id = eos
        self.bos_id = bos if bos is not None else eos
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids))


def mistral_sentencepiece_path() -> Path:
    """Path of the 32000-piece Llama-style SentencePiece model inside the mistral-common wheel."""
    try:
        import mistral_common
    except ImportError as e:
        raise MissingPackageError(
            "The default tokenizer ships in `mistral-common`: pip install mistral-common"
        ) from e
    return Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


def corpus_bpe_path(corpus, vocab_size: int) -> Path:
    """A SentencePiece BPE model of `vocab_size` pieces trained on the lines of the corpus's train split (byte
    fallback: any text encodes; bos 1, eos 2, unk 0), made on first use (seconds) and cached under
    MEMLM_CACHE/tokenizers/ by the corpus fingerprint and size."""
    import sentencepiece as spm

    from data.corpus import default_cache_dir

    if vocab_size < 300:
        raise ConfigError(f"tokenizer.vocab_size must be >= 300 (256 byte pieces + merges), got {vocab_size}")
    path = (
        default_cache_dir()
        / "tokenizers"
        / f"{corpus.name.split(':')[0]}-{corpus.fingerprint}-bpe{vocab_size}.model"
    )
    if path.exists():
        return path
    log.info(
        "Training a %d-piece BPE vocabulary on the train split of %s (once) ...", vocab_size, corpus.name
    )
    lines = (line for doc in corpus.splits["train"] for line in doc.text.split("\n") if line.strip())
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        max_sentence_length=1 << 16,
        num_threads=1,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    tmp.replace(path)  # atomic: a concurrent run sees the whole file or none
    return path


def build_tokenizer(
    kind: str = "sentencepiece",
    name: str | None = None,
    gguf_file: str | None = None,
    vocab_size: int | None = None,
    corpus=None,
) -> Tokenizer:
    """kind='sentencepiece' (name = model file, default mistral-common's), 'hf' (name = hub id or path) or 'bpe'
    (`vocab_size` pieces trained on `corpus`, see corpus_bpe_path)."""
    if kind == "sentencepiece":
        return SentencePieceTokenizer(name or mistral_sentencepiece_path())
    if kind == "bpe":
        if corpus is None or vocab_size is None:
            raise ConfigError(
                "tokenizer=bpe is trained on a corpus: it needs tokenizer.vocab_size and corpus=..."
            )
        return SentencePieceTokenizer(corpus_bpe_path(corpus, vocab_size))
    if kind == "hf":
        if not name:
            raise ConfigError("tokenizer=hf needs a name or path: tokenizer.name=gpt2 (or a local folder)")
        return HFTokenizer(name, gguf_file=gguf_file)
    raise ConfigError(f"Unknown tokenizer kind {kind!r}; valid: 'sentencepiece', 'hf', 'bpe'")
