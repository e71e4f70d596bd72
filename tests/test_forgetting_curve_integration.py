"""Forgetting curve in the framework: task-model predictors, the corpus evaluator, the callback and its config."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import nn

from callbacks.forgetting_curve import (
    ForgettingCurveCallback,
    ForgettingCurveResult,
    evaluate_forgetting_curve,
    length_grid,
    model_predictor,
)
from data.corpus import Corpus, Document
from data.tokenizer import build_tokenizer
from tests.test_train import TINY, compose_train
from tests.tiny_models import tiny_hf_llama_lm, tiny_llama_lm
from train import train

WINDOW = 40


@pytest.mark.parametrize(
    ("build", "full_forward"),
    [
        (tiny_llama_lm, lambda lm, ids: lm.backbone.logits(ids)),
        (tiny_hf_llama_lm, lambda lm, ids: lm.backbone.model(input_ids=ids).logits),  # HF's own forward
    ],
    ids=["llama", "hf_llama"],
)
def test_predictions_are_the_argmax_of_a_full_forward_within_the_window(build, full_forward):
    lm = build(window=WINDOW)
    ids = torch.randint(0, 32, (3, WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full_forward(lm, ids).argmax(-1)
    assert torch.equal(model_predictor(lm)(ids), expected)
    longer = torch.randint(0, 32, (2, 3 * WINDOW + 1))  # sliding window: every position gets a prediction
    assert model_predictor(lm)(longer).shape == longer.shape


class CopyOracle(nn.Module):
    """A task model that copies perfectly within `window` tokens: in [bos] S [bos] S [eos] (or [bos] I [bos] S
    [eos]) position t predicts the token l positions back, i.e. what followed the token l + 1 positions back,
    when l + 1 <= window; token 0 otherwise. Logits come in two chunks, as from a streaming model."""

    def __init__(self, window: int, vocab_size: int):
        super().__init__()
        self.window, self.vocab_size = window, vocab_size
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the model a device
        self.seen: list[torch.Tensor] = []

    def iter_logits(self, input_ids: torch.Tensor):
        self.seen.append(input_ids)
        length = (input_ids.shape[1] - 3) // 2
        predicted = torch.zeros_like(input_ids)
        if length + 1 <= self.window:
            predicted[:, length:] = input_ids[:, : input_ids.shape[1] - length]
        logits = nn.functional.one_hot(predicted, self.vocab_size).float()
        half = input_ids.shape[1] // 2
        yield from (logits[:, :half], logits[:, half:])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def numbered_text(doc: int, n: int = 60) -> str:
    return " ".join(
        f"Speech {doc} item {doc * 100 + i} names the {['river', 'hill', 'town'][i % 3]}." for i in range(n)
    )


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Corpus:
    monkeypatch.setenv("MEMLM_CACHE", str(tmp_path / "cache"))  # tokenized splits cached here
    docs = [Document(f"doc{i}", numbered_text(i)) for i in range(6)]
    return Corpus("tiny-fc", {"train": docs[:2], "validation": docs[2:4], "test": docs[4:]})


def test_evaluate_forgetting_curve_finds_the_oracle_memory_and_writes_its_files(tokenizer, corpus, tmp_path):
    oracle = CopyOracle(window=30, vocab_size=tokenizer.vocab_size)
    metrics = evaluate_forgetting_curve(
        oracle, tokenizer, corpus, tmp_path / "fc", max_len=48, n_lengths=6, n_samples=3, progress=False
    )
    assert length_grid(48, 6) == [8, 16, 24, 32, 40, 48]
    assert metrics == {
        "forgetting/fine_len": 24.0,
        "forgetting/coarse_len": 24.0,
    }  # the largest l with l + 1 <= 30
    result = ForgettingCurveResult.load_json(tmp_path / "fc" / "forgetting_curve.json")
    assert result.copy_acc == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert (tmp_path / "fc" / "forgetting_curve.csv").is_file()
    assert (tmp_path / "fc" / "forgetting_curve.png").read_bytes().startswith(b"\x89PNG")
    for batch in oracle.seen:  # the tokenizer's specials frame every input
        assert (batch[:, 0] == tokenizer.bos_id).all() and (batch[:, -1] == tokenizer.eos_id).all()
    assert oracle.training  # the model's mode is restored
    with pytest.raises(ValueError, match="no split 'dev'"):
        evaluate_forgetting_curve(oracle, tokenizer, corpus, tmp_path, max_len=8, n_lengths=1, split="dev")


class RecordingWandb(WandbLogger):
    """A WandbLogger that only records its table and image calls (no W&B run)."""

    def __init__(self):  # no super().__init__: nothing of W&B is started
        self.calls = []

    def log_table(self, key, columns=None, data=None, step=None, **kwargs):
        self.calls.append(("table", key, columns, data, step))

    def log_image(self, key, images, step=None, **kwargs):
        self.calls.append(("image", key, images, step))


def test_callback_runs_every_n_validations_and_logs_scalars_table_and_plot(tokenizer, corpus, tmp_path):
    wandb, logged = RecordingWandb(), {}
    trainer = SimpleNamespace(
        sanity_checking=False,
        is_global_zero=True,
        global_step=7,
        default_root_dir=str(tmp_path),
        loggers=[wandb],
        datamodule=SimpleNamespace(tokenizer=tokenizer, corpus=corpus),
    )
    module = SimpleNamespace(
        model=CopyOracle(window=20, vocab_size=tokenizer.vocab_size),
        log=lambda name, value, **kwargs: logged.__setitem__(name, value),
    )
    callback = ForgettingCurveCallback(every_n_val=2, max_len=32, n_lengths=4, n_samples=2)
    callback.on_validation_epoch_end(SimpleNamespace(**{**vars(trainer), "sanity_checking": True}), module)
    callback.on_validation_epoch_end(trainer, module)
    assert not logged and not wandb.calls  # the sanity check does not count; the first validation is skipped
    callback.on_validation_epoch_end(trainer, module)
    assert logged == {"val/forgetting/fine_len": 16.0, "val/forgetting/coarse_len": 16.0}
    (_, key, columns, rows, step), (_, image_key, images, _) = wandb.calls
    assert (key, step, image_key) == ("val/forgetting", 7, "val/forgetting/plot")
    assert columns[:2] == ["length", "copy_acc"] and [r[:2] for r in rows] == [
        [8, 1.0],
        [16, 1.0],
        [24, 0.0],
        [32, 0.0],
    ]
    assert Path(images[0]) == tmp_path / "forgetting" / "step7" / "forgetting_curve.png"


def test_train_with_the_forgetting_curve_callback_config(tmp_path):
    cfg = compose_train(
        [
            *TINY,
            "callbacks=forgetting_curve",
            "callbacks.forgetting_curve.max_len=16",
            "callbacks.forgetting_curve.n_lengths=2",
            "callbacks.forgetting_curve.n_samples=2",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            f"run_dir={tmp_path}",
        ]
    )
    metrics = train(cfg)
    assert {"val/forgetting/fine_len", "val/forgetting/coarse_len"} <= set(metrics)
    saved = json.loads((tmp_path / "forgetting" / "step2" / "forgetting_curve.json").read_text())
    assert saved["lengths"] == [8, 16] and saved["coarse_length"] == metrics["val/forgetting/coarse_len"]
