"""Backbone warm start on bAbI stories: the compact copy computes the full backbone's logits at the task's tokens,
the dense loss falls and only the task's rows change, and `backbone_init` loads the saved weights exactly (or fails naming the command that creates them)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from data.babi import generate_task
from data.babilong import TaskTokens, collate
from data.tokenizer import build_tokenizer
from models import pretrain_babi
from models.backbone import build_llama
from models.builders import load_backbone_init
from models.pretrain_babi import (
    TaskVocabulary,
    compact_backbone,
    facts_only,
    losses,
    pretrain,
    save_backbone,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def tiny(tok, seed: int = 0):
    torch.manual_seed(seed)
    return build_llama(tok.vocab_size, 32, 2, 2, 2, 64, 256)


def test_compact_copy_computes_the_full_backbones_logits_at_the_task_tokens(tok):
    tasks = TaskTokens(generate_task("qa1", n=50, seed=0), tok)
    vocab, model = TaskVocabulary(tasks, tok.pad_id), tiny(tok)
    batch = collate([facts_only(tasks, i) for i in range(4)], tok.pad_id, context_loss=True)
    small, compact = compact_backbone(model, vocab), vocab.compact(batch)
    full = model.logits(batch["input_ids"], attention_mask=batch["attention_mask"])[..., vocab.ids]
    torch.testing.assert_close(
        small.logits(compact["input_ids"], attention_mask=batch["attention_mask"]), full
    )
    scored = batch["labels"] != -100
    assert bool((vocab.ids[compact["labels"][scored]] == batch["labels"][scored]).all())


def test_dense_pretraining_learns_and_writes_back_only_the_task_rows(tok):
    model = tiny(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tasks = TaskTokens(generate_task("qa1", n=64, seed=5), tok)
    vocab = TaskVocabulary(TaskTokens(generate_task("qa1", n=2000, seed=0), tok), tok.pad_id)
    batch = vocab.compact(collate([facts_only(tasks, i) for i in range(64)], tok.pad_id))
    loss_before = losses(compact_backbone(model, vocab), batch)[0].item()
    pretrain(model, tok, steps=60, n_pool=2000, n_val=64, eval_every=60, log=lambda line: None)
    assert losses(compact_backbone(model, vocab), batch)[0].item() < 0.7 * loss_before
    others = torch.ones(tok.vocab_size, dtype=torch.bool).index_fill_(0, vocab.ids, False)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(model.state_dict()[name][others], before[name][others])
        assert not torch.equal(model.state_dict()[name][vocab.ids], before[name][vocab.ids])


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


def test_backbone_init_refuses_a_file_saved_for_another_config(tok, tmp_path):
    """Same shapes, other model: alibi / heads of another width would load silently without the config check."""
    model, path = tiny(tok, seed=1), tmp_path / "tiny_qa1.pt"
    save_backbone(model, path, OmegaConf.create({"hidden_size": 32, "n_heads": 2}), task="qa1")
    same, other = ({"hidden_size": 32, "n_heads": n, "alibi": n == 4} for n in (2, 4))
    load_backbone_init(model, str(path), OmegaConf.create(same))  # alibi=false: what the file predates
    with pytest.raises(
        ValueError, match=r"\(n_heads: 2 in the file, 4 now, alibi: None in the file, True now\)"
    ):
        load_backbone_init(model, str(path), OmegaConf.create(other))


def test_pretraining_says_what_it_does_and_its_bar_ends_full_when_it_stops_early(tok, monkeypatch):
    """Was: no word of what runs or how long, and a bar left at "75%" when the target stopped the run."""
    bars = []

    class Recorded(pretrain_babi.Progress):
        def stop(self) -> None:
            bars.extend((t.completed, t.total) for t in self.tasks)
            super().stop()

    monkeypatch.setattr(pretrain_babi, "Progress", Recorded)
    lines = []
    pretrain(tiny(tok), tok, steps=100, n_pool=500, n_val=16, eval_every=5, target_accuracy=0.0,
             log=lines.append, progress=True)  # fmt: skip
    assert lines[0].startswith(
        "Warm start: next-token training of the backbone on qa1 facts-only stories, up to 100"
    )
    assert "every 5 steps, stopping once it reaches 0.0" in lines[0]
    evaluation = json.loads(lines[1])
    assert evaluation["step"] == 5 and evaluation["eta_min"] >= 0
    assert lines[2].startswith("Reached facts-only exact match") and lines[2].endswith("at step 5: stopping.")
    assert bars == [(5, 5)]
