"""BABILong haystacks: sentence splitting and its cache, exact sizes, facts in order at sentence boundaries of one
contiguous (cyclic) background stream, train/held-out separation, batch layout, the official format, exact match
and the heat map, and clear errors on bad input."""

from __future__ import annotations

import itertools

import numpy as np
import PIL.Image
import pytest
import torch

from callbacks.babilong_eval import ExactMatch, accuracy_table, plot_accuracy_heatmap
from data.babi import generate_task
from data.babilong import (
    Haystack,
    HaystackSet,
    OfficialSet,
    TaskTokens,
    check_task,
    collate,
    length_name,
    load_official,
    make_sample,
)
from data.corpus import Corpus, Document
from data.curriculum import BabilongDataModule, CurriculumCallback
from data.sentences import encode_pieces, split_sentences, tokenize_sentences
from data.tokenizer import Tokenizer, build_tokenizer
from tests.figures import assert_texts_inside

MARKERS = {"train": "harvest", "validation": "frontier", "test": "treaty"}
SHARED = "Thank you all."


def tiny_corpus(docs_per_split=(4, 2, 2), sentences=30) -> Corpus:
    """Each split's sentences carry the split's marker word; one sentence occurs in a train and a held-out doc."""
    splits = {}
    for split, n_docs in zip(MARKERS, docs_per_split, strict=True):
        docs = []
        for d in range(n_docs):
            text = " ".join(
                f"The {MARKERS[split]} speech {d} mentions the {['river', 'mountain', 'city'][i % 3]} {i} times."
                for i in range(sentences)
            )
            docs.append(Document(f"{split}-{d}", f"{text} {SHARED}" if d == 0 else text))
        splits[split] = docs
    return Corpus("tiny", splits)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer()


@pytest.fixture(scope="module")
def stores(tok, tmp_path_factory):
    return tokenize_sentences(tiny_corpus(), tok, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def qa1(tok) -> TaskTokens:
    return TaskTokens(generate_task("qa1", n=40, seed=0), tok)


# ---- sentences ----------------------------------------------------------------------------------------------
def test_split_sentences_handles_abbreviations_quotes_and_paragraphs():
    text = 'Mr. Smith went to Washington. He said: "Hello there!" Then he left.\n\nA new paragraph.'
    assert split_sentences(text) == [
        "Mr. Smith went to Washington.",
        'He said: "Hello there!"',
        "Then he left.",
        "A new paragraph.",
    ]


class CharTokenizer(Tokenizer):
    """Byte-level stand-in without a word-start marker (like GPT-2): 'a' + 'b' decodes to 'ab'."""

    name, vocab_size, bos_id, eos_id, pad_id = "chars", 256, 1, 2, 2

    def encode_batch(self, texts):
        return [list(t.encode()) for t in texts]

    def decode(self, ids):
        return bytes(ids).decode()


@pytest.mark.parametrize("make", [build_tokenizer, CharTokenizer], ids=["sentencepiece", "bytes"])
def test_pieces_concatenate_to_space_joined_text(make):
    tok = make()
    pieces = encode_pieces(tok, ["Mary went home.", "Where is Mary?", "home"])
    assert tok.decode(sum(pieces, [])).strip() == "Mary went home. Where is Mary? home"


def test_sentence_cache_is_reused_and_matches_the_split(tok, tmp_path, monkeypatch):
    corpus = tiny_corpus()
    first = tokenize_sentences(corpus, tok, tmp_path)
    monkeypatch.setattr("data.sentences.encode_pieces", lambda *a: pytest.fail("cache not used"))
    second = tokenize_sentences(corpus, tok, tmp_path)
    for split in MARKERS:
        np.testing.assert_array_equal(first[split].tokens, second[split].tokens)
    doc = corpus.splits["train"][1]
    expected = split_sentences(doc.text)
    offset = len(split_sentences(corpus.splits["train"][0].text))
    got = [tok.decode(second["train"].sentence(offset + i).tolist()) for i in range(len(expected))]
    assert got == expected


def test_held_out_background_shares_no_sentence_with_training(stores, tok):
    shared = np.asarray(encode_pieces(tok, [SHARED])[0], dtype=np.uint32).tobytes()
    assert shared in stores["train"].keys()
    for split in ("validation", "test"):
        assert not stores[split].keys() & stores["train"].keys()
        assert len(stores[split]) == 2 * 30  # the shared sentence is gone, nothing else


# ---- haystack -----------------------------------------------------------------------------------------------
def locate_in_order(context: np.ndarray, facts: list[np.ndarray]) -> list[int]:
    """Start of each fact, searched left to right after the previous one."""
    starts, pos = [], 0
    for f in facts:
        hits = [
            p for p in range(pos, len(context) - len(f) + 1) if np.array_equal(context[p : p + len(f)], f)
        ]
        assert hits, "fact missing or out of order"
        starts.append(hits[0])
        pos = hits[0] + len(f)
    return starts


@pytest.mark.parametrize("n_background", [1, 17, 250, 2500])  # 2500 > the held-out split: read cyclically
def test_context_is_facts_at_sentence_boundaries_of_one_background_stream(stores, qa1, n_background):
    store = stores["validation"]
    hay = Haystack(store, "validation")
    cycles = 3 + n_background // store.n_tokens
    tiled = np.tile(store.tokens, cycles)
    for i in range(10):
        facts = qa1.facts[i]
        context = hay.context(facts, n_background, np.random.default_rng(i))
        assert len(context) == n_background + sum(len(f) for f in facts)
        starts = locate_in_order(context, facts)
        keep = np.ones(len(context), bool)
        for s, f in zip(starts, facts, strict=True):
            keep[s : s + len(f)] = False
        background = context[keep]
        begin = [c for c in store.offsets[:-1] if np.array_equal(tiled[c : c + n_background], background)]
        assert begin, "background is not a contiguous run of sentences from a sentence start"
        cuts = [s - sum(len(f) for f in facts[:j]) for j, s in enumerate(starts)]  # in background coordinates
        boundaries = {
            int(o) + m * store.n_tokens - int(begin[0]) for o in store.offsets for m in range(cycles)
        }
        assert all(c in boundaries or c == n_background for c in cuts)


def test_samples_have_exact_sizes_and_fail_clearly_when_too_small(stores, qa1):
    hay = Haystack(stores["train"], "train")
    rng = np.random.default_rng(0)
    for i in range(10):
        s = make_sample(qa1, i, hay, rng, length=300)
        assert s.context_len == 300 and len(s.input_ids) == 300 + qa1.extra_len[i]
        assert len(make_sample(qa1, i, hay, rng, total=384).input_ids) == 384
        assert make_sample(qa1, i, hay, rng, length=0).context_len == qa1.facts_len[i]  # facts only
    with pytest.raises(ValueError, match="smaller than its .* fact tokens"):
        make_sample(qa1, 0, hay, rng, length=int(qa1.facts_len[0]) - 1)
    with pytest.raises(ValueError, match="No sample fits length 5: the shortest needs"):
        HaystackSet(qa1, hay, [0], n=4, length=5)


def test_eval_set_sample_is_a_function_of_seed_and_index(stores, qa1):
    hay = Haystack(stores["validation"], "validation")
    a, b = HaystackSet(qa1, hay, [7], n=8, length=200), HaystackSet(qa1, hay, [7], n=8, length=200)
    np.testing.assert_array_equal(a[3].input_ids, b[3].input_ids)
    assert not np.array_equal(a[3].input_ids, HaystackSet(qa1, hay, [8], n=8, length=200)[3].input_ids)
    assert len({a[i].input_ids.tobytes() for i in range(8)}) == 8


def test_facts_only_batches_take_rows_of_one_length_band_and_every_sample_equally(tok, qa1):
    """qa2's stories run from 17 to ~500 tokens: a batch's rows come from one 128-token band (so little padding),
    the band drawn by its share of samples, so each sample is as likely as in a uniform draw (chi-square over the
    bands); a task within one band (qa1) draws exactly as rng.integers over the pool."""
    from data.babilong import FACTS_ONLY_BAND

    pool = TaskTokens(generate_task("qa2", n=3000, seed=0), tok)
    length = pool.facts_len + pool.extra_len
    assert len(pool.bands) >= 3 and sorted(np.concatenate(pool.bands)) == list(range(len(pool)))
    rng, counts, draws = np.random.default_rng(0), np.zeros(len(pool.bands)), 2000
    for _ in range(draws):
        rows = pool.draw_facts_only(rng, 8)
        band = length[rows] // FACTS_ONLY_BAND
        assert len(set(band.tolist())) == 1
        counts[[int(band[0]) == int(length[b[0]] // FACTS_ONLY_BAND) for b in pool.bands].index(True)] += 1
    expected = draws * np.array([len(b) for b in pool.bands]) / len(pool)
    assert ((counts - expected) ** 2 / expected).sum() < 20  # chi-square, a few degrees of freedom
    assert len(qa1.bands) == 1
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert np.array_equal(qa1.draw_facts_only(a, 16), b.integers(len(qa1), size=16))


def test_a_token_budget_gives_long_bands_fewer_rows_and_keeps_samples_equally_likely(tok, qa1):
    """With max_tokens, a band of stories up to 128 (b + 1) tokens gets max_tokens // (128 (b + 1)) rows, and each
    sample is still drawn equally often: bands come in proportion to samples / rows (chi-square over the rows)."""
    from data.babilong import FACTS_ONLY_BAND

    pool = TaskTokens(generate_task("qa2", n=3000, seed=0), tok)
    length = pool.facts_len + pool.extra_len
    budget, size = 1024, 8
    rng, rows_by_band = np.random.default_rng(0), np.zeros(len(pool.bands))
    for _ in range(3000):
        rows = pool.draw_facts_only(rng, size, max_tokens=budget)
        b = int(length[rows[0]] // FACTS_ONLY_BAND)
        assert (length[rows] // FACTS_ONLY_BAND == b).all()
        assert len(rows) == max(1, min(size, budget // (FACTS_ONLY_BAND * (b + 1))))
        rows_by_band[list(pool.band_ids).index(b)] += len(rows)
    expected = rows_by_band.sum() * np.array([len(b) for b in pool.bands]) / len(pool)
    assert (
        (rows_by_band - expected) ** 2 / expected
    ).sum() < 40  # a few degrees of freedom, rows come in groups
    a, b = np.random.default_rng(3), np.random.default_rng(3)  # one band within the budget: the plain draw
    assert np.array_equal(qa1.draw_facts_only(a, 16, max_tokens=4096), b.integers(len(qa1), size=16))


@pytest.mark.parametrize("budget", [None, 4096])
def test_evaluation_batches_hold_every_sample_once_within_rows_and_token_budget(tok, budget):
    """qa3 stories run to 2k tokens: padded batches stay within the budget (one long story alone may pass it), every
    batch is as full as the limits allow (the next story would break one), and each sample comes once."""
    pool = TaskTokens(generate_task("qa3", n=500, seed=0), tok)
    length = pool.facts_len + pool.extra_len
    batches = pool.facts_only_batches(64, budget)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(pool)))

    def fits(rows):
        return len(rows) <= 64 and (
            budget is None or len(rows) == 1 or len(rows) * length[rows].max() <= budget
        )

    assert all(fits(b) for b in batches)
    assert not any(fits(np.append(b, nxt[0])) for b, nxt in itertools.pairwise(batches))
    assert (len(batches) > len(pool) // 64 + 1) == (budget is not None)


def test_collate_left_pads_and_scores_answer_then_eos(stores, qa1, tok):
    hay = Haystack(stores["train"], "train")
    rng = np.random.default_rng(0)
    samples = [make_sample(qa1, i, hay, rng, length=n) for i, n in [(0, 120), (1, 90)]]
    for context_loss in (False, True):
        b = collate(samples, tok.pad_id, context_loss, task="qa1")
        assert b["task"] == "qa1" and b["input_ids"].shape == (2, 120 + qa1.extra_len[0])
        for row, s in enumerate(samples):
            T, n = b["input_ids"].shape[1], len(s.input_ids)
            assert b["attention_mask"][row].tolist() == [0] * (T - n) + [1] * n
            assert b["input_ids"][row, T - n] == tok.bos_id
            positions = b["answer_mask"][row].nonzero().squeeze(1)
            assert positions.tolist() == list(range(T - 1 - s.n_answer, T - 1))
            answer = b["labels"][row, positions].tolist()
            assert answer == qa1.answer[row].tolist() + [tok.eos_id]
            scored = (b["labels"][row] != -100).nonzero().squeeze(1)
            expected = torch.arange(T - n, T - 1) if context_loss else positions
            torch.testing.assert_close(scored, expected)
            torch.testing.assert_close(b["labels"][row, scored], b["input_ids"][row, scored + 1])


# ---- data module: separation and bad input ------------------------------------------------------------------
def test_training_and_evaluation_background_come_from_their_own_splits(tok, tmp_path):
    dm = BabilongDataModule(
        tok, tiny_corpus(), segment_size=128, schedule=[2], n_train=20, n_val=4, n_test=4,
        val_lengths=[300], test_lengths=[300], cache_dir=str(tmp_path),
    )  # fmt: skip
    train_text = " ".join(tok.decode(row.tolist()) for j in range(5) for row in dm.batch(2, j)["input_ids"])
    val_text = " ".join(
        tok.decode(r.tolist()) for dl in dm.val_dataloader() for b in dl for r in b["input_ids"]
    )
    test_text = " ".join(
        tok.decode(r.tolist()) for dl in dm.test_dataloader() for b in dl for r in b["input_ids"]
    )
    assert MARKERS["train"] in train_text and SHARED in train_text
    assert not {MARKERS["validation"], MARKERS["test"]} & set(train_text.split())
    assert MARKERS["validation"] in val_text and not {MARKERS["train"], MARKERS["test"]} & set(
        val_text.split()
    )
    assert MARKERS["test"] in test_text and not {MARKERS["train"], MARKERS["validation"]} & set(
        test_text.split()
    )
    assert SHARED not in val_text + test_text


def test_bad_input_raises_clear_errors(tok, tmp_path):
    with pytest.raises(ValueError, match="Unknown BABILong task 'qa21'; valid: qa1, qa2"):
        check_task("qa21")
    with pytest.raises(ValueError, match="Unknown BABILong task"):
        BabilongDataModule(tok, tiny_corpus(), task="qa0")
    empty = Corpus("empty", {"train": [Document("a", "  \n ")], "validation": [], "test": []})
    dm = BabilongDataModule(tok, empty, n_train=4, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'train' background split has no sentences"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"val_segments has no set at \[4\] segments"):
        BabilongDataModule(
            tok, tiny_corpus(), schedule=[2, 4], val_segments=[2], callback=CurriculumCallback()
        )
    with pytest.raises(
        ValueError, match="shortest sample needs 2 segments of 32 tokens.*first background stage has 1"
    ):
        BabilongDataModule(
            tok, tiny_corpus(), task="qa3", segment_size=32, n_train=50, cache_dir=str(tmp_path)
        ).setup()


# ---- official BABILong format --------------------------------------------------------------------------------
def test_official_babilong_folder_loads_through_the_same_interface(tok, tmp_path):
    import datasets

    rows = {
        "input": ["Mary went to the kitchen. It rained all day.", "John moved to the garden."],
        "question": ["Where is Mary?", "Where is John?"],
        "target": ["kitchen", "garden"],
    }
    (tmp_path / "1k").mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "1k" / "qa1-00000-of-00001.parquet"))
    ds = load_official(str(tmp_path), "qa1", 1024)
    sample = OfficialSet(ds, tok)[0]
    assert tok.decode(sample.input_ids.tolist()) == f"{rows['input'][0]} Where is Mary? Answer: kitchen"
    dm = BabilongDataModule(tok, tiny_corpus(), official=str(tmp_path), test_lengths=[1024], n_test=1)
    assert dm.test_names == ["qa1/acc@1k"]
    (batch,) = list(dm.test_dataloader()[0])
    assert batch["length"] == 1024 and len(batch["input_ids"]) == 1
    assert batch["labels"][batch["answer_mask"]].tolist() == encode_pieces(tok, ["kitchen"])[0] + [tok.eos_id]
    with pytest.raises(FileNotFoundError, match="No qa2 file"):
        load_official(str(tmp_path), "qa2", 1024)


# ---- metric and heat map --------------------------------------------------------------------------------------
def test_exact_match_metric_matches_a_per_sample_loop(stores, qa1, tok):
    hay = Haystack(stores["train"], "train")
    rng = np.random.default_rng(0)
    batch = collate([make_sample(qa1, i, hay, rng, length=60 + i) for i in range(6)], tok.pad_id, True)
    scored = (batch["labels"] != -100).nonzero()
    targets = batch["labels"][batch["labels"] != -100]
    logits = torch.nn.functional.one_hot(targets, int(targets.max()) + 2).float()  # all right
    rows, cols = scored[:, 0], scored[:, 1]
    is_answer = batch["answer_mask"][rows, cols]
    for row, answer_pos in [(1, True), (2, False), (4, True)]:  # one wrong prediction each
        n = int(((rows == row) & (is_answer == answer_pos)).nonzero()[0])
        logits[n] = logits[n].roll(1)
    metric = ExactMatch()
    metric.update(logits, targets, batch)
    expected = []
    for b in range(6):
        ok = [
            int(logits[n].argmax()) == int(targets[n])
            for n, (row, t) in enumerate(scored.tolist())
            if row == b and batch["answer_mask"][row, t]
        ]
        expected.append(float(all(ok)))
    assert expected == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # a wrong context prediction does not count
    torch.testing.assert_close(metric.compute(), torch.tensor(sum(expected) / 6))


def test_heatmap_orders_sizes_and_reads_logged_metrics(tmp_path):
    metrics = {
        "test/qa2/acc@1M": 0.1,
        "test/qa10/acc@0k": 1.0,
        "test/qa2/acc@0k": 0.9,
        "test/qa2/acc@4k": 0.5,
        "val/qa2/acc@1k": 0.3,
        "test/loss": 2.0,
    }
    table = accuracy_table(metrics, "test")
    assert table == {"qa2": {"1M": 0.1, "0k": 0.9, "4k": 0.5}, "qa10": {"0k": 1.0}}
    fig = plot_accuracy_heatmap(table, tmp_path / "heat.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["facts only", "4k", "1M"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["qa2", "qa10"]
    assert sorted(t.get_text() for t in ax.texts) == ["10", "100", "50", "90"]
    assert (tmp_path / "heat.png").stat().st_size > 0
    assert [length_name(n) for n in (0, 1024, 131072, 2**20, 1000)] == ["0k", "1k", "128k", "1M", "1000"]


@pytest.mark.parametrize("n_tasks,n_sizes", [(1, 1), (1, 2), (3, 9), (20, 12)])
def test_heatmap_holds_its_title_labels_and_colour_bar_at_any_grid_size(tmp_path, n_tasks, n_sizes):
    """At a 1 x 1 grid the old heat map was 390 x 162 px with the title and colour-bar label cut off."""
    sizes = [length_name(1024 * j) for j in range(n_sizes)]
    table = {f"qa{i + 1}": {s: 0.5 for s in sizes} for i in range(n_tasks)}
    fig = plot_accuracy_heatmap(table, tmp_path / "heat.png", title="BABILong test accuracy")
    assert_texts_inside(fig)
    width, height = PIL.Image.open(tmp_path / "heat.png").size
    assert width >= 600 and height >= 360
