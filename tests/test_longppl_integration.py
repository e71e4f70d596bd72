"""LongPPL in the framework: the corpus evaluator vs brute force, cross-tokenizer keys, the key cache, the callback."""

import csv
import json
import math

import pytest
import torch
from hydra.utils import instantiate

from callbacks.checkpoint import load_checkpoint
from callbacks.longppl import Evaluator, evaluate_longppl, longppl_documents
from data.corpus import Corpus, Document
from data.tokenizer import Tokenizer, build_tokenizer
from evaluate import build_from_checkpoint
from tests.test_longppl import threshold_between
from tests.test_train import TINY, compose_train
from tests.tiny_models import brute_force_logprobs, tiny_llama_lm
from train import train

K, D, MAX_LEN = 8, 4, 40


class CharTokenizer(Tokenizer):
    """One token per character (code point mod 128), so its tokens never line up with SentencePiece pieces."""

    name, vocab_size, bos_id, eos_id, pad_id = "chars", 128, 1, 2, 2

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[3 + ord(c) % 125 for c in text] for text in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return self.encode(text), [(i, i + 1) for i in range(len(text))]


def numbered_text(doc: int, n: int = 20) -> str:
    return " ".join(
        f"Speech {doc} item {doc * 100 + i} names the {['river', 'hill', 'town'][i % 3]}." for i in range(n)
    )


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Corpus:
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))  # key-token cache (and token caches) here
    docs = [Document(f"doc{i}", numbered_text(i)) for i in range(5)]
    return Corpus("tiny-longppl", {"train": docs[:1], "validation": docs[1:3], "test": docs[3:]})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def lm(tokenizer):
    return tiny_llama_lm(vocab_size=tokenizer.vocab_size, window=64, seed=0, init_std=0.3)


def lsd_threshold(lsd: torch.Tensor) -> float:
    """A threshold between two middle LSD values, skipping the exact zeros of windows that start at token 0 (there
    short = long context, and the batched and the single forwards differ by rounding only)."""
    return threshold_between(lsd[lsd.abs() > 1e-3])


def evaluated_tokens(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.bos_id, *tokenizer.encode(text)[: MAX_LEN - 1]])


def test_self_evaluated_longppl_matches_the_brute_force_definition(lm, tokenizer, corpus, tmp_path):
    docs = [evaluated_tokens(tokenizer, d.text) for d in corpus.splits["test"]]
    per_doc = [brute_force_logprobs(lm.backbone.logits, t, K, D) for t in docs]  # (long, short, has_short)
    lsd = torch.cat([(long - short)[has] for long, short, has in per_doc])
    lcl = torch.cat([long[has] for long, _, has in per_doc])
    alpha, beta = lsd_threshold(lsd), threshold_between(lcl)
    keys = [has & (long - short > alpha) & (long > beta) for long, short, has in per_doc]
    key_nll = torch.cat([-long[key] for (long, _, _), key in zip(per_doc, keys, strict=True)])
    all_nll = torch.cat([-long[1:] for long, _, _ in per_doc])

    metrics = evaluate_longppl(
        lm, tokenizer, corpus, tmp_path, "self", K, D, alpha, beta, max_docs=None, max_len=MAX_LEN
    )

    assert 0 < key_nll.numel() < lsd.numel()
    assert metrics["longppl/n_key"] == key_nll.numel() and metrics["longppl/n_tokens"] == all_nll.numel()
    torch.testing.assert_close(metrics["longppl"], key_nll.double().mean().exp().item(), rtol=1e-5, atol=0)
    torch.testing.assert_close(metrics["ppl"], all_nll.double().mean().exp().item(), rtol=1e-5, atol=0)
    with open(tmp_path / "longppl.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["n_key"]) for r in rows] == [int(k.sum()) for k in keys]
    assert json.loads((tmp_path / "longppl.json").read_text())["settings"]["evaluator"] == "self"


def test_keys_of_another_tokenizer_map_through_characters_and_are_cached(lm, tokenizer, corpus):
    chars = CharTokenizer()
    char_lm = tiny_llama_lm(vocab_size=chars.vocab_size, window=512, seed=1, init_std=0.3)
    texts, char_tokens, char_runs = [], [], []
    for doc in corpus.splits["test"]:
        ids, offsets = tokenizer.encode_with_offsets(doc.text)
        texts.append(doc.text[: offsets[MAX_LEN - 2][1]])  # what the evaluated tokens cover
        char_tokens.append(torch.tensor([chars.bos_id, *chars.encode(texts[-1])]))
        char_runs.append(brute_force_logprobs(char_lm.backbone.logits, char_tokens[-1], K, D))
    alpha = lsd_threshold(torch.cat([(long - short)[has] for long, short, has in char_runs]))
    settings = dict(split="test", max_docs=None, max_len=MAX_LEN, K=K, d=D, alpha=alpha, beta=-math.inf)

    docs = longppl_documents(tokenizer, corpus, Evaluator(char_lm, chars, "chars-test"), **settings)

    for doc, text, (long, short, has) in zip(docs, texts, char_runs, strict=True):
        key_chars = set((has & (long - short > alpha))[1:].nonzero()[:, 0].tolist())  # char i is token i + 1
        ids, offsets = tokenizer.encode_with_offsets(text)
        expected = [False] + [e > s and set(range(s, e)) <= key_chars for s, e in offsets[: MAX_LEN - 1]]
        assert doc.key_mask.tolist() == expected and torch.equal(
            doc.tokens, evaluated_tokens(tokenizer, text)
        )
    assert 0 < sum(int(d.key_mask.sum()) for d in docs) < sum(len(d.tokens) for d in docs) // 2

    class Unusable(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(()))

        def iter_logits(self, input_ids):
            raise AssertionError("the evaluator ran although its key tokens are cached")

    cached = longppl_documents(tokenizer, corpus, Evaluator(Unusable(), chars, "chars-test"), **settings)
    assert all(torch.equal(a.key_mask, b.key_mask) for a, b in zip(cached, docs, strict=True))
    with pytest.raises(AssertionError, match="ran although"):  # other thresholds: other cache entries
        longppl_documents(
            tokenizer, corpus, Evaluator(Unusable(), chars, "chars-test"), **{**settings, "alpha": 0.0}
        )


def test_train_with_the_longppl_callback_and_a_checkpoint_as_evaluator(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))
    longppl = ["evaluator=self", "K=8", "d=8", "max_docs=1", "max_len=64"]
    cfg = compose_train(
        [*TINY, "callbacks=longppl", *[f"callbacks.longppl.{o}" for o in longppl]]
        + ["trainer.max_steps=2", "trainer.val_check_interval=2", f"run_dir={tmp_path}"]
    )
    metrics = train(cfg)
    assert {"val/longppl", "val/longppl/ppl", "val/longppl/n_key", "val/longppl/n_tokens"} <= set(metrics)
    assert metrics["val/longppl/n_tokens"] == 63 and math.isfinite(metrics["val/longppl/ppl"])
    assert (tmp_path / "longppl" / "step2" / "longppl.csv").is_file()

    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    model, tokenizer, _ = build_from_checkpoint(load_checkpoint(ckpt), ckpt)
    corpus = instantiate(cfg.corpus)
    args = dict(K=8, d=8, alpha=0.5, beta=-4.0, max_docs=1, max_len=64, split="validation")
    by_self = evaluate_longppl(model, tokenizer, corpus, tmp_path / "self", evaluator="self", **args)
    by_ckpt = evaluate_longppl(model, tokenizer, corpus, tmp_path / "ckpt", evaluator=str(ckpt), **args)
    assert by_ckpt == by_self
    assert len(list((tmp_path / "cache" / "longppl_keys").glob("*.pt"))) == 1  # only the checkpoint is cached


@pytest.mark.slow
def test_smollm2_evaluator_gives_key_tokens_for_another_tokenizer(lm, tokenizer, corpus, tmp_path):
    metrics = evaluate_longppl(
        lm, tokenizer, corpus, tmp_path, "smollm2", K=16, d=16, max_docs=1, max_len=128
    )
    assert metrics["longppl/n_tokens"] == 127 and 0 < metrics["longppl/n_key"] < 127
