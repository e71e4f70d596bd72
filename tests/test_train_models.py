"""`python train.py model=... task=...` end to end for the memory models: RMT, RMT-R and ARMT on BABILong with the
curriculum, Llama-XL on ordered LM streams, each with CE and LongCE; the run's checkpoint and figures land."""

import math

import pytest

from tests.test_train import TINY, compose_train
from train import train

TINY_BACKBONE = ["backbone=tiny", "backbone.hidden_size=32", "backbone.ffn_size=64"]
QUICK = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.enable_progress_bar=false"]
QA1 = [
    "task=qa1",
    "model.segment_size=48",
    "model.num_memory=2",
    "task.batch_size=2",
    "task.n_train=50",
    "task.n_val=4",
    "task.eval_batch_size=4",
    "task.num_workers=0",
    "task.val_segments=[2]",
    "curriculum.schedule=[2]",
]


@pytest.mark.parametrize("model,loss", [("rmt", "ce"), ("rmt_r", "longce"), ("armt", "longce")])
def test_memory_models_train_on_babilong_and_draw_memory_maps(tmp_path, model, loss):
    cfg = compose_train(
        [f"model={model}", f"loss={loss}", *TINY_BACKBONE, *QA1, *QUICK, f"run_dir={tmp_path}"]
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and 0 <= metrics["val/qa1/acc@2seg"] <= 1
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert [p.name for p in tmp_path.glob("memory_maps*")] == ["memory_maps.png"]  # one image, the newest


@pytest.mark.parametrize("loss", ["ce", "longce"])
def test_llama_xl_trains_on_ordered_streams(tmp_path, loss):
    cfg = compose_train([*TINY, "model=llama_xl", f"loss={loss}", *QUICK, f"run_dir={tmp_path}"])
    assert cfg.model.segment_size == cfg.task.seq_len and cfg.task.ordered
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/ppl"])
    assert not (tmp_path / "memory_maps.png").exists()
    logged = {"train/ce", "train/longce_weight", "train/longce_up", "train/longce_down"}
    assert logged <= metrics.keys() if loss == "longce" else not logged & metrics.keys()
