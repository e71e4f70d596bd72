"""Backbone warm start on bAbI stories: restricted-vocabulary logits equal the full head's, the dense loss falls,
and `backbone_init` loads the saved weights exactly (or fails naming the command that creates them)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from data.babi import generate_task
from data.babilong import TaskTokens, collate
from data.tokenizer import build_tokenizer
from models.backbone import build_llama
from models.builders import load_backbone_init
from models.pretrain_babi import TaskVocabulary, facts_only, losses, pretrain, save_backbone


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny(tok, seed: int = 0):
    torch.manual_seed(seed)
    return build_llama(tok.vocab_size, 32, 2, 2, 2, 64, 256)


def test_task_vocabulary_logits_are_the_full_heads_at_those_tokens(tok):
    tasks = TaskTokens(generate_task("qa1", n=50, seed=0), tok)
    vocab, model = TaskVocabulary(tasks, tok.vocab_size), tiny(tok)
    batch = collate([facts_only(tasks, i) for i in range(4)], tok.pad_id, context_loss=True)
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(vocab.logits(model, hidden), model.head(hidden)[..., vocab.ids])
    scored = batch["labels"][batch["labels"] != -100]
    assert bool((vocab.ids[vocab.index[scored]] == scored).all())  # every target is in the vocabulary


def test_dense_pretraining_lowers_the_answer_loss(tok):
    model = tiny(tok)
    tasks = TaskTokens(generate_task("qa1", n=64, seed=5), tok)
    batch = collate([facts_only(tasks, i) for i in range(64)], tok.pad_id)
    vocab = TaskVocabulary(TaskTokens(generate_task("qa1", n=2000, seed=0), tok), tok.vocab_size)
    before = losses(model, vocab, batch)[0].item()
    pretrain(model, tok, steps=60, n_pool=2000, n_val=64, eval_every=60, log=lambda line: None)
    assert losses(model, vocab, batch)[0].item() < 0.6 * before


def test_backbone_init_loads_the_saved_weights_exactly(tok, tmp_path):
    saved, fresh = tiny(tok, seed=1), tiny(tok, seed=2)
    path = tmp_path / "tiny_qa1.pt"
    save_backbone(saved, path, OmegaConf.create({"hidden_size": 32}), task="qa1")
    load_backbone_init(fresh, str(path))
    for (name, a), b in zip(saved.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(FileNotFoundError, match="python -m models.pretrain_babi"):
        load_backbone_init(fresh, str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="does not fit"):
        load_backbone_init(build_llama(tok.vocab_size, 64, 2, 2, 2, 64, 256), str(path))
