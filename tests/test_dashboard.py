"""The W&B dashboard of a run, read back from its offline files: curriculum stage and segments over steps, accuracy
per length as one chart, memory maps (one image per validation), forgetting curve and PPL by position (tables and
plots with their step), the BABILong heat map, the config, the checkpoint paths, and evaluate.py's results at the
checkpoint's step in the same run."""

import glob
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from evaluate import evaluate
from tests.test_evaluate import compose_eval
from tests.test_train import compose_train
from tests.wandb_reader import read_offline_run, read_offline_summary
from train import train

RMT_QA1 = [
    "model=rmt",
    "task=qa1",
    "backbone=tiny",
    "backbone.hidden_size=32",
    "backbone.ffn_size=64",
    "model.segment_size=64",
    "model.num_memory=2",
    "task.batch_size=2",
    "task.n_train=50",
    "task.n_val=2",
    "task.n_test=2",
    "task.eval_batch_size=2",
    "task.num_workers=0",
    "task.test_lengths=[0,128]",
    "task.test_segments=[2]",
    "curriculum.schedule=[1,2]",
    "curriculum.callback.max_steps_per_stage=2",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false",
    "test=true",
    "logger=wandb",
    "callbacks=forgetting_curve",
    "callbacks.forgetting_curve.max_len=16",
    "callbacks.forgetting_curve.n_lengths=2",
    "callbacks.forgetting_curve.n_samples=2",
    "+callbacks.ppl_by_position._target_=callbacks.ppl_by_position.PplByPosition",
    "+callbacks.ppl_by_position.max_len=64",
    "+callbacks.ppl_by_position.n_bins=2",
    "+callbacks.ppl_by_position.kind=linear",
]


def logged(history: list[dict], key: str) -> dict[int, object]:
    """{trainer/global_step: value} of a key over a run's history rows; a media value (image, table) is the dict
    of its `key/...` fields."""
    out = {}
    for row in history:
        media = {k[len(key) + 1 :]: v for k, v in row.items() if k.startswith(f"{key}/")}
        if "trainer/global_step" in row and (key in row or "_type" in media):
            out[row["trainer/global_step"]] = row[key] if key in row else media
    return out


EVALUATE_BABILONG = [
    "eval=[babilong]",  # tasks: the checkpoint's own, qa1
    "eval.babilong.lengths=[0]",
    "eval.babilong.n=2",
    "eval.babilong.batch_size=2",
]


class Dashboard(NamedTuple):
    run_dir: Path
    config: dict
    history: list[dict]
    summary: dict
    eval_history: list[dict]
    train_metrics: dict[str, float]  # what train() returned


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """A 4-step RMT run on qa1 with W&B (offline), then evaluate.py on its last checkpoint."""
    import wandb

    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        metrics = train(compose_train([*RMT_QA1, f"run_dir={run_dir}"]))
        wandb.finish()
        evaluate(compose_eval([f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", *EVALUATE_BABILONG]))
    runs = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")), key=os.path.getmtime)
    assert len(runs) == 2 and len({Path(r).stem for r in runs}) == 1  # evaluate.py continued the training run
    (config, history), (_, eval_history) = (read_offline_run(Path(r)) for r in runs)
    return Dashboard(run_dir, config, history, read_offline_summary(Path(runs[0])), eval_history, metrics)


def test_curriculum_stage_and_segments_over_steps(dashboard):
    history = dashboard.history
    stage, segments = logged(history, "train/curriculum_stage"), logged(history, "train/curriculum_segments")
    assert (
        set(stage) >= {0, 1, 2, 3} and stage[0] == 0 and stage[3] == 1
    )  # next stage after step 2's validation
    assert segments[0] == 1 and segments[3] == 2


def test_train_returns_the_last_validation_and_the_test_sets(dashboard):
    metrics = dashboard.train_metrics
    assert {"val/qa1/acc@2seg", "test/qa1/acc@2seg", "test/qa1/acc@0k", "test/qa1/acc@128"} <= metrics.keys()


def test_accuracy_per_length_is_one_chart(dashboard):
    history = dashboard.history
    chart = logged(history, "val/accuracy_by_length_table")  # wandb.plot.line_series: one line per length
    assert set(chart) == {2, 4} and chart[4]["_type"] == "table-file"
    assert chart[4]["nrows"] == 4  # the whole history: 2 lengths (1 and 2 segments) x 2 validations


def test_images_and_tables_carry_their_step(dashboard):
    run_dir, history = dashboard.run_dir, dashboard.history
    maps = logged(history, "val/memory_maps")
    assert set(maps) == {2, 4} and maps[4]["count"] == 1  # one image per validation
    assert [p.name for p in run_dir.glob("memory_maps*")] == [
        "memory_maps.png"
    ]  # one file on disk: the newest
    for key in ("val/forgetting", "val/ppl_by_position"):
        assert set(logged(history, key)) == {2, 4}, key
        assert logged(history, key)[4]["_type"] == "table-file"
        assert set(logged(history, f"{key}/plot")) == {2, 4}, key
    assert logged(history, "test/babilong_heatmap")[4]["_type"] == "images/separated"


def test_config_and_checkpoint_paths(dashboard):
    run_dir, config, summary = dashboard.run_dir, dashboard.config, dashboard.summary
    assert config["model"]["_target_"] == "models.rmt.build_rmt" and config["curriculum"]["schedule"] == [
        1,
        2,
    ]
    assert summary["checkpoint/last"] == str((run_dir / "checkpoints" / "last.ckpt").resolve())
    assert Path(summary["checkpoint/best"]).parent == (run_dir / "checkpoints").resolve()


def test_evaluate_results_land_at_the_checkpoints_step(dashboard):
    eval_history = dashboard.eval_history
    assert set(logged(eval_history, "eval/babilong/acc")) == {4}
    tasks = {k.split("/")[2] for row in eval_history for k in row if k.startswith("eval/babilong/qa")}
    assert tasks == {"qa1"}  # the task the checkpoint was trained on, not qa1-qa5
    assert set(logged(eval_history, "eval/babilong/heatmap")) == {4}
