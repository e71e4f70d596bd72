"""Every config composes, and every `_target_` accepts the arguments its config gives it (nothing is built)."""

import inspect
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from models.builders import register_resolvers
from models.config_checks import (
    MODEL_KEYS_FOR_OTHER_GROUPS,
    config_problems,
    node_problems,
    signature_of,
    targets,
)
from models.lit_module import wsd_lambda

CONFIGS = Path(__file__).parents[1] / "configs"
GROUPS = [
    "tokenizer",
    "corpus",
    "backbone",
    "model",
    "task",
    "curriculum",
    "loss",
    "trainer",
    "logger",
    "callbacks",
    "experiment",
]
RUNTIME_ARGS = {"tokenizer", "corpus", "backbone", "model", "out_dir"}  # passed by the builders at run time
# `${required:...}` values, which the command line gives
REQUIRED = {"curriculum32_from": ["init_from=as_typed.ckpt"]}

register_resolvers()


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_train(overrides: list[str]) -> DictConfig:
    with initialize(config_path="../configs", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def assert_binds(path: str, node: DictConfig) -> None:
    """Every key is an argument of the target, of the declared type; every required argument is given."""
    problems = node_problems(path, node, node._target_)
    assert not problems, "\n".join(problems)
    sig, _ = signature_of(node._target_)
    kwargs = set(node) - set(MODEL_KEYS_FOR_OTHER_GROUPS if path == "model" else ())
    missing = [
        n
        for n, p in sig.parameters.items()
        if p.default is p.empty
        and p.kind is p.POSITIONAL_OR_KEYWORD
        and n not in kwargs
        and n not in RUNTIME_ARGS
        and n != "self"
    ]
    assert not missing, f"{path}: {node._target_} needs {missing} which the config does not give"


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_binds(group):
    for option in options(group):
        cfg = compose_train([f"{group}={option}", *REQUIRED.get(option, [])])
        OmegaConf.resolve(cfg)
        for path, node in targets(cfg):
            assert_binds(path, node)
        assert not config_problems(cfg)  # what train.py checks before building


@pytest.mark.parametrize("curriculum", options("curriculum"))
def test_every_curriculum_composes_with_the_babilong_recipe(curriculum):
    """task=qa* loads the tiny backbone's recipe, which sets the staged curricula's CPU values; every curriculum,
    staged or fixed, still composes to a callback that builds (or none)."""
    cfg = compose_train(["model=rmt", "task=qa1", f"curriculum={curriculum}"])
    OmegaConf.resolve(cfg)
    assert cfg.task.callback is None or "_target_" in cfg.task.callback, cfg.task.callback
    for path, node in targets(cfg):
        assert_binds(path, node)
    assert not config_problems(cfg)


@pytest.mark.parametrize("experiment", ["curriculum32", "curriculum32_from"])
def test_the_curricula_run_their_32_segment_stage_in_the_lr_decay(experiment):
    """The decay starts (within a step) where the last stage does when every stage spends its step budget: a 32-segment
    stage at full rate lost what the 16-segment stage had formed (docs/babilong_curriculum.md)."""
    cfg = compose_train([f"experiment={experiment}", *REQUIRED.get(experiment, [])])
    o = cfg.optim
    lr = wsd_lambda(o.warmup_steps, cfg.trainer.max_steps, o.stable_ratio, o.min_lr_ratio)
    last_stage = (len(cfg.curriculum.schedule) - 1) * cfg.curriculum.callback.max_steps_per_stage
    assert cfg.curriculum.schedule[-1] == 32
    assert lr(last_stage - 2) == 1.0 and lr(last_stage) < 1.0


def test_trainer_config_lists_every_trainer_argument():
    cfg = OmegaConf.load(CONFIGS / "trainer" / "default.yaml")
    args = set(inspect.signature(L.Trainer.__init__).parameters) - {"self", "logger", "callbacks", "plugins"}
    assert args <= set(cfg), f"trainer/default.yaml lacks {sorted(args - set(cfg))}"


def test_unknown_group_option_lists_valid_choices():
    with pytest.raises(ConfigCompositionException) as e:
        compose_train(["model=transformer_xxl"])
    assert "transformer_xxl" in str(e.value) and "llama" in str(e.value)


def test_model_defaults_pick_their_backbone_and_cli_wins():
    assert compose_train(["model=llama"]).backbone.hidden_size == 512
    assert compose_train(["model=llama", "backbone=tiny"]).backbone.hidden_size == 64
    assert compose_train(["backbone=hf", "backbone.name=gpt2"]).tokenizer.kind == "hf"


@pytest.mark.parametrize("option", options("eval"))
def test_every_evaluator_composes_and_binds(option):
    with initialize(config_path="../configs", version_base="1.3"):
        cfg = compose(config_name="eval", overrides=[f"eval=[{option}]"])
    OmegaConf.resolve(cfg)
    for path, node in targets(cfg.eval):
        assert_binds(f"eval.{path}", node)
