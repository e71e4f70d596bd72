"""A checkpoint is code: one from elsewhere must not run anything when train.py, evaluate.py or the watcher load it.
Its config may only name the project's builders (the `_target_`s of configs/), and it must load with
`weights_only=True`."""

import logging
import pathlib

import pytest
import torch
from test_evaluate import compose_eval
from test_faults import compose_train, tiny_overrides

from callbacks.checkpoint import UnsafeCheckpointError, load_checkpoint
from callbacks.watch import watch
from evaluate import CheckpointEvaluator, evaluate
from models.run_config import RENAMED_TARGETS, UnsafeTargetError, allowed_targets, checkpoint_config
from train import train


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    train(compose_train(tiny_overrides(run, 2, 2)))
    return run / "checkpoints" / "last.ckpt"


def planted(good, folder, node) -> pathlib.Path:
    """A copy of a real checkpoint whose tokenizer config is `node` (evaluate.py builds the tokenizer first)."""
    checkpoint = load_checkpoint(good)
    checkpoint["config"]["tokenizer"] = node
    folder.mkdir(exist_ok=True)
    torch.save(checkpoint, folder / "evil.ckpt")
    return folder / "evil.ckpt"


def attacks(victim: pathlib.Path, good: pathlib.Path) -> dict[str, tuple[str, object]]:
    """{attack: (the target it names, the config node)}"""
    copy = {"_target_": "shutil.copyfile", "src": str(good), "dst": str(victim)}
    return {
        "copyfile": ("shutil.copyfile", copy),
        "open": ("builtins.open", {"_target_": "builtins.open", "file": str(victim), "mode": "w"}),
        # an arbitrary file write through a function of the project's own modules
        "project_function": (
            "callbacks.watch.write_json",
            {"_target_": "callbacks.watch.write_json", "path": str(victim), "data": {}},
        ),
        # hidden in an interpolation that only resolving reveals
        "interpolation": (
            "shutil.copyfile",
            f"${{oc.create:{{_target_: shutil.copyfile, src: '{good}', dst: '{victim}'}}}}",
        ),
    }


@pytest.mark.parametrize("attack", ["copyfile", "open", "project_function", "interpolation"])
def test_a_checkpoint_naming_foreign_code_is_refused_and_nothing_runs(good, tmp_path, attack, caplog):
    victim = tmp_path / "victim.txt"
    target, node = attacks(victim, good)[attack]
    evil = planted(good, tmp_path / "checkpoints", node)
    refused = rf"evil.ckpt names _target_ '{target}' \(at tokenizer\), which is not a builder of this project"

    with pytest.raises(UnsafeTargetError, match=refused):
        evaluate(compose_eval([f"ckpt_path={evil}", "logger=csv"]))
    with pytest.raises(UnsafeTargetError, match=refused):  # train.py resumes from the checkpoint's config
        train(compose_train([f"run_dir={tmp_path / 'new'}", f"ckpt_path={evil}"]), [f"ckpt_path={evil}"])
    caplog.set_level(logging.ERROR, logger="callbacks.watch")
    evaluator = CheckpointEvaluator(compose_eval(["logger=csv"]), tmp_path)
    assert watch(evil.parent, evaluator, once=True, settle_s=0) == []  # logged, and the watcher goes on
    evaluator.close()
    assert any(isinstance(r.exc_info[1], UnsafeTargetError) for r in caplog.records if r.exc_info)
    assert not victim.exists()


def test_every_target_of_the_configs_is_a_project_builder_or_a_lightning_class():
    allowed = allowed_targets()
    assert {
        "models.backbone.build_llama",
        "data.tokenizer.build_tokenizer",
        "lightning.pytorch.Trainer",
    } <= allowed
    prefixes = ("models.", "data.", "losses.", "callbacks.", "evaluate.", "lightning.pytorch.")
    assert all(t.startswith(prefixes) for t in allowed), sorted(allowed)
    assert "callbacks.watch.write_json" not in allowed


class Touch:
    """Unpickling this touches a file (any pickled callable could run anything)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_a_checkpoint_that_unpickles_code_is_refused(good, tmp_path):
    victim = tmp_path / "victim.txt"
    checkpoint = load_checkpoint(good)
    checkpoint["config"]["note"] = Touch(victim)
    evil = tmp_path / "evil.ckpt"
    torch.save(checkpoint, evil)
    with pytest.raises(UnsafeCheckpointError, match=f"Refusing to load {evil}: it holds Python objects"):
        load_checkpoint(evil)
    with pytest.raises(UnsafeCheckpointError):
        evaluate(compose_eval([f"ckpt_path={evil}", "logger=csv"]))
    assert not victim.exists()


def test_a_checkpoint_of_an_earlier_version_loads_with_the_successors_of_retired_targets(good):
    """Checkpoints written before callbacks.progress replaced Lightning's RichProgressBar still evaluate/resume."""
    checkpoint = load_checkpoint(good)
    checkpoint["config"]["callbacks"]["progress_bar"] = {
        "_target_": "lightning.pytorch.callbacks.RichProgressBar"
    }
    config = checkpoint_config(checkpoint, good)
    assert config.callbacks.progress_bar._target_ == "callbacks.progress.StepProgressBar"
    assert set(RENAMED_TARGETS.values()) <= allowed_targets()
    assert not set(RENAMED_TARGETS) & allowed_targets()  # a retired target is not named by configs/ any more
