"""The EMA of the weights (callbacks/weight_average.py): the run it averages takes the same steps as without it, the
average is the EMA of the trained weights written out by hand, checkpoints hand it out, a resume continues it
exactly, and `test=true` tests it."""

from pathlib import Path

import lightning as L
import pytest
import torch

from callbacks.checkpoint import load_checkpoint
from callbacks.weight_average import TrainedWeightsEMA
from models.builders import Run, build_run
from models.config_errors import ConfigError
from tests.test_faults import CrashAt, compose_train, read_metrics, tiny_overrides
from train import train

DECAY = 0.8
EMA = ["callbacks=weight_average", f"callbacks.weight_average.decay={DECAY}"]


class RecordWeights(L.Callback):
    """The trainable weights after every optimizer step, and those the test sees."""

    def __init__(self):
        self.after_step: list[dict[str, torch.Tensor]] = []
        self.tested: dict[str, torch.Tensor] | None = None

    @staticmethod
    def weights(pl_module) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in pl_module.named_parameters() if p.requires_grad}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(self.weights(pl_module))

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.tested = self.weights(pl_module)


def fit(run_dir: Path, max_steps: int, *extra: str, crash_at: int | None = None) -> tuple[Run, RecordWeights]:
    """A tiny LM run (validation every 2 steps) with its weights recorded."""
    run = build_run(compose_train(tiny_overrides(run_dir, max_steps, 2, *extra)))
    record = RecordWeights()
    run.trainer.callbacks += [record] + ([CrashAt(crash_at)] if crash_at else [])
    run.trainer.fit(run.module, datamodule=run.datamodule)
    return run, record


def test_the_run_takes_the_same_steps_and_its_checkpoint_holds_the_ema(tmp_path):
    # 7 steps, validation every 2: the last checkpoint is written at the end of training, after on_train_end
    (_, plain), (_, averaged) = fit(tmp_path / "plain", 7), fit(tmp_path / "ema", 7, *EMA)
    # validation sees the trained weights
    assert read_metrics(tmp_path / "plain") == read_metrics(tmp_path / "ema")
    for a, b in zip(plain.after_step, averaged.after_step, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit: the callback changes no step
    ema = averaged.after_step[0]  # as Lightning's AveragedModel: the first update copies
    for w in averaged.after_step[1:]:
        ema = {k: DECAY * ema[k] + (1 - DECAY) * w[k] for k in w}
    ckpt = load_checkpoint(tmp_path / "ema/checkpoints/last.ckpt")
    for k, v in ema.items():
        torch.testing.assert_close(ckpt["state_dict"][k], v, rtol=1e-6, atol=1e-7)
        assert torch.equal(ckpt["current_model_state"][k], averaged.after_step[-1][k])
    plain_ckpt = load_checkpoint(tmp_path / "plain/checkpoints/last.ckpt")
    assert any(not torch.equal(ckpt["state_dict"][k], plain_ckpt["state_dict"][k]) for k in ema)


def test_a_resumed_run_continues_the_average_exactly(tmp_path):
    fit(tmp_path / "a", 8, *EMA)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path / "b", 8, *EMA, crash_at=5)  # last.ckpt at step 4
    resume = [f"run_dir={tmp_path / 'b'}", "ckpt_path=last"]
    train(compose_train(resume), resume)
    a = load_checkpoint(tmp_path / "a/checkpoints/last.ckpt")
    b = load_checkpoint(tmp_path / "b/checkpoints/last.ckpt")
    for key in ("state_dict", "current_model_state"):
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7)


def test_the_test_after_training_sees_the_average_and_training_resumes_from_the_trained_weights(tmp_path):
    run, record = fit(tmp_path, 4, *EMA)
    run.trainer.test(run.module, datamodule=run.datamodule, verbose=False)
    ckpt = load_checkpoint(tmp_path / "checkpoints/last.ckpt")
    assert all(torch.equal(record.tested[k], ckpt["state_dict"][k]) for k in record.tested)
    trained = RecordWeights.weights(run.module)  # swapped back after the test
    assert all(torch.equal(trained[k], record.after_step[-1][k]) for k in trained)


def test_a_decay_outside_zero_one_is_refused_with_its_name():
    with pytest.raises(ConfigError, match=r"callbacks.weight_average.decay must lie in \(0, 1\), got 1.0"):
        TrainedWeightsEMA(decay=1.0)
