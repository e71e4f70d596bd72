"""LM datamodules: deterministic, resumable, worker- and rank-safe batches; ordered streams continue and reset."""

import logging

import numpy as np
import pytest
import torch

from data.corpus import Corpus, Document, load_corpus, split_documents
from data.lm_datamodule import BatchStream, LMDataModule, OrderedStreams, ShuffledChunks
from data.tokenizer import build_tokenizer
from models.config_errors import ConfigError
from models.errors import UserError


def docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [np.concatenate([[1], rng.integers(3, 500, n), [2]]) for n in lengths]


def take(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_shuffled_chunks_are_deterministic_and_cover_each_epoch():
    make = ShuffledChunks(docs([300, 500, 200]), seq_len=16, batch_size=4, seed=3)
    a, b = make(5), make(5)
    assert torch.equal(a["input_ids"], b["input_ids"])
    torch.testing.assert_close(a["labels"][:, :-1], a["input_ids"][:, 1:])
    epoch = torch.cat([make(j)["input_ids"] for j in range(make.per_epoch)])
    assert len({tuple(r.tolist()) for r in epoch}) == make.per_epoch * 4  # no chunk twice in one epoch


@pytest.mark.parametrize("random_span", [False, True])
def test_repeat_share_turns_rows_into_a_span_repeated_and_leaves_the_rest_as_text(random_span):
    plain = ShuffledChunks(docs([3000, 2000]), seq_len=64, batch_size=8, seed=3)
    mixed = ShuffledChunks(
        docs([3000, 2000]), seq_len=64, batch_size=8, seed=3, repeat_share=0.5, repeat_random=random_span
    )
    n_repeated, spans = 0, set()
    for j in range(20):
        text, batch = plain(j), mixed(j)
        assert torch.equal(batch["input_ids"], mixed(j)["input_ids"])  # a pure function of j (resumable)
        rows = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1)  # (B, T+1) chunks
        text_rows = torch.cat([text["input_ids"], text["labels"][:, -1:]], 1)
        for b in range(8):
            if torch.equal(rows[b], text_rows[b]):
                continue
            (k,) = [k for k in range(16, 33) if torch.equal(rows[b, k:], rows[b, :-k])][:1]  # its period
            if random_span:  # tokens of the corpus, not the row's text
                assert set(rows[b].tolist()) <= set(mixed.pool.tolist()) and not torch.equal(
                    rows[b, :k], text_rows[b, :k]
                )
            else:  # the row's own first k tokens
                assert torch.equal(rows[b, :k], text_rows[b, :k])
            n_repeated, spans = n_repeated + 1, spans | {k}
    assert 50 < n_repeated < 110 and len(spans) > 10  # about half the 160 rows, spans of 16..32 tokens
    dm = LMDataModule(None, None, seq_len=64, batch_size=8, repeat_share=0.5, repeat_random=random_span)
    dm.splits = {"train": docs([3000, 2000]), "validation": docs([3000, 2000])}
    # validation stays text; the training stream is the repeated one
    assert torch.equal(dm.make_stream("validation", 3)(0)["input_ids"], plain(0)["input_ids"])
    assert torch.equal(dm.make_stream("train", 3)(0)["input_ids"], mixed(0)["input_ids"])
    with pytest.raises(ConfigError, match=r"repeat_share is a share .* in \[0, 1\]"):
        LMDataModule(None, None, repeat_share=1.5)
    with pytest.raises(ConfigError, match="an ordered .* stream cannot take it"):
        LMDataModule(None, None, ordered=True, repeat_share=0.5)


def test_stream_resumes_and_splits_across_workers_and_ranks():
    make = ShuffledChunks(docs([2000]), seq_len=8, batch_size=2, seed=0)
    full = take(BatchStream(make), 6)
    resumed = take(BatchStream(make, start=3), 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(full[3:], resumed, strict=True))
    loader = torch.utils.data.DataLoader(BatchStream(make), batch_size=None, num_workers=2)
    assert all(
        torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(full, take(loader, 6), strict=True)
    )
    r0, r1 = (
        take(BatchStream(make, rank=0, world_size=2), 3),
        take(BatchStream(make, rank=1, world_size=2), 3),
    )
    interleaved = [b for pair in zip(r0, r1, strict=True) for b in pair]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(full, interleaved, strict=True))


def test_ordered_streams_continue_and_reset_at_document_starts():
    d = docs([40, 25, 33, 61, 18])
    make = OrderedStreams(d, seq_len=8, batch_size=2, pad_id=0, seed=0)
    batches = [make(j) for j in range(12)]
    for j in range(11):
        cur, nxt = batches[j], batches[j + 1]
        for b in range(2):
            if not nxt["reset"][b]:  # continues: the next input is this segment's last target
                assert nxt["input_ids"][b, 0] == cur["labels"][b, -1]
            else:  # a new document starts with BOS, the previous segment ended its document
                assert nxt["input_ids"][b, 0] == 1
    assert batches[0]["reset"].all()
    # every document token is predicted exactly once per pass: labels of row segments rebuild the documents
    n = len(make.segments[0])
    labels = torch.cat([make(j)["labels"][0] for j in range(n)])
    row_docs = list(dict.fromkeys(i for i, _ in make.segments[0]))
    assert labels[labels != -100].tolist() == np.concatenate([d[i][1:] for i in row_docs]).tolist()
    padded = batches[0]["attention_mask"] == 0
    assert (batches[0]["labels"][padded] == -100).all()


def test_split_is_by_document_and_deterministic():
    ds = [Document(f"d{i}", "x" * 10) for i in range(50)]
    a, b = split_documents(ds, 0.1, 0.1, seed=1), split_documents(list(reversed(ds)), 0.1, 0.1, seed=1)
    assert [d.name for d in a["test"]] == [d.name for d in b["test"]]
    names = [{d.name for d in a[s]} for s in ("train", "validation", "test")]
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])


def test_kjv_corpus_is_the_66_books_as_plain_text():
    corpus = load_corpus("kjv")
    books = {d.name: d.text for split in corpus.splits.values() for d in split}
    assert len(books) == 66 and sum(map(len, books.values())) > 4_000_000
    genesis, revelation = books["01 Genesis"], books["66 Revelation"]
    assert genesis.startswith(
        "In the beginning God created the heaven and the earth. And the earth was without"
    )
    assert genesis.count("\n\n") == 49  # 50 chapters
    assert revelation.endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert not any(c in text for text in books.values() for c in "[]")  # no verse numbers or brackets
    assert "1. " not in genesis[:200] and " 2. " not in genesis[:200]
    assert [d.name for d in corpus.splits["test"]] == ["08 Ruth", "43 John", "25 Lamentations"]


def test_python_corpus_is_the_standard_library_source():
    corpus = load_corpus("python")
    docs = {d.name: d.text for split in corpus.splits.values() for d in split}
    assert len(docs) > 1000 and sum(map(len, docs.values())) > 10_000_000
    assert (
        "def dumps(" in docs["json/__init__.py"] and "class Counter(dict):" in docs["collections/__init__.py"]
    )
    assert not any(name.startswith(("site-packages", "dist-packages")) for name in docs)
    assert load_corpus("python").fingerprint == corpus.fingerprint  # deterministic split


def test_folder_corpus_reads_the_files_a_pattern_names(tmp_path):
    (tmp_path / "sub").mkdir()
    for i in range(5):
        (tmp_path / "sub" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n")
        (tmp_path / f"n{i}.txt").write_text(f"note {i}")
    corpus = load_corpus("folder", str(tmp_path), 0.2, 0.2, pattern="*.py")
    names = sorted(d.name for split in corpus.splits.values() for d in split)
    assert names == [f"sub/m{i}.py" for i in range(5)]
    assert corpus.fingerprint != load_corpus("folder", str(tmp_path), 0.2, 0.2).fingerprint
    with pytest.raises(ConfigError, match=r"No \.md files under .*corpus.pattern"):
        load_corpus("folder", str(tmp_path), pattern="*.md")


def test_bpe_tokenizer_is_trained_on_the_train_split_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path))
    lines = lambda i: "\n".join(f"The quick brown fox {i} jumps over the lazy dog {j}." for j in range(40))  # noqa: E731
    corpus = Corpus("mini", split_documents([Document(f"d{i}", lines(i)) for i in range(10)], 0.1, 0.1, 0))
    tok = build_tokenizer("bpe", vocab_size=400, corpus=corpus)
    assert tok.vocab_size == 400 and (tok.sp.unk_id(), tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "The quick brown fox: naïve café, 🦊 jumps!"
    assert tok.decode(tok.encode(text)) == text  # byte fallback: any text encodes
    assert (
        len(tok.encode("The quick brown fox jumps over the lazy dog")) <= 9
    )  # merges learned from the corpus
    (path,) = (tmp_path / "tokenizers").glob("mini-*-bpe400.model")
    mtime = path.stat().st_mtime_ns
    assert build_tokenizer("bpe", vocab_size=400, corpus=corpus).fingerprint == tok.fingerprint
    assert path.stat().st_mtime_ns == mtime  # the cached vocabulary, not trained again
    with pytest.raises(ConfigError, match="tokenizer.vocab_size must be >= 300"):
        build_tokenizer("bpe", vocab_size=100, corpus=corpus)
    with pytest.raises(ConfigError, match="it needs tokenizer.vocab_size and corpus"):
        build_tokenizer("bpe", vocab_size=400)


def test_folder_corpus_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="corpus.path"):
        load_corpus("folder")
    with pytest.raises(FileNotFoundError, match="Corpus folder not found"):
        load_corpus("folder", path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="No .txt files"):
        load_corpus("folder", path=str(tmp_path))


def test_undecodable_corpus_files_are_named_and_refused_above_the_threshold(tmp_path, caplog):
    """Was: a folder of Latin-1 or binary files trained silently on U+FFFD (44% of the text)."""
    text = "Plain text about the garden and the kitchen. " * 40
    for i in range(4):
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(
        (text + "Caf\xe9 au lait. ").encode("latin-1")
    )  # 1 bad byte in 1.8k
    with caplog.at_level(logging.WARNING, logger="data.corpus"):
        corpus = load_corpus("folder", str(tmp_path), 0.2, 0.2)
    assert "1 files under" in caplog.text and "latin1.txt (0.1%)" in caplog.text and "U+FFFD" in caplog.text
    docs = {d.name: d.text for split in corpus.splits.values() for d in split}
    assert docs["latin1.txt"].endswith("Caf\ufffd au lait. ")

    (tmp_path / "binary.txt").write_bytes(
        bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8))
    )
    with pytest.raises(ConfigError) as e:
        load_corpus("folder", str(tmp_path), 0.2, 0.2)
    assert isinstance(e.value, UserError)
    assert "1 of 6 files under" in str(e.value) and "binary.txt (" in str(e.value)
    assert "latin1.txt" not in str(e.value) and "corpus.encoding=<their encoding>" in str(e.value)
    share = float(str(e.value).split("binary.txt (")[1].split("%")[0])
    assert 40 < share < 60  # about half of random bytes are not UTF-8 (or NUL)

    (tmp_path / "binary.txt").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data.corpus"):
        corpus = load_corpus("folder", str(tmp_path), 0.2, 0.2, encoding="latin-1")
    assert not caplog.text
    docs = {d.name: d.text for split in corpus.splits.values() for d in split}
    assert docs["latin1.txt"].endswith("Café au lait. ")


def test_datamodule_on_a_folder_corpus(tmp_path):
    from data.tokenizer import build_tokenizer

    for i in range(6):
        (tmp_path / f"doc{i}.txt").write_text(f"Document number {i}. " * 200)
    tok = build_tokenizer()
    dm = LMDataModule(
        tok,
        load_corpus("folder", str(tmp_path), 0.2, 0.2),
        seq_len=32,
        batch_size=2,
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 32) and int(batch["input_ids"][0, 0]) >= 0
    assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in dm.splits["train"])
