"""Checks of a composed config before anything is built, so that a bad value fails with its key named, not deep
inside Lightning or torch: every key of a `_target_` node is an argument of its target (else the closest one is
suggested), every value has the type the target's signature declares, and the accelerator asked for exists here.
Ranges (a batch size >= 1, ...) are checked by the classes themselves, which raise `ConfigError`.
"""

from __future__ import annotations

import collections.abc as abc
import difflib
import inspect
import os
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.config_errors import ConfigError

# Config nodes without a `_target_` that are passed as keyword arguments: node -> (callable, arguments given by code)
KWARGS_NODES = {"optim": ("models.lit_module.LitModule", {"model", "loss", "config"})}
# Keys of a model config that configure other groups, not the model builder: `backbone` (backbone keys the model
# needs, read by configs/backbone/*.yaml) and `ordered_data` (the LM task streams documents in order).
MODEL_KEYS_FOR_OTHER_GROUPS = ("backbone", "ordered_data")
SEQUENCES = (list, tuple, set, frozenset, abc.Sequence, abc.Iterable, abc.Collection, abc.MutableSequence)


def check_config(cfg: DictConfig, groups: tuple[str, ...] | None = None) -> None:
    """Raise one `ConfigError` listing every problem of the config (of its top-level `groups` only: the ones the
    caller builds) and every accelerator it asks for but lacks."""
    problems = config_problems(cfg, groups)
    if isinstance(cfg.get("trainer"), DictConfig):
        trainer = cfg.trainer
        problems += device_problems("trainer.accelerator", trainer.get("accelerator"), trainer.get("devices"))
    if "device" in cfg:
        problems += device_problems("device", cfg.device)
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))


def config_problems(cfg: DictConfig, groups: tuple[str, ...] | None = None) -> list[str]:
    """Keys that are no argument of their target, and values of the wrong type (`node_problems` of each node)."""
    problems = []
    for path, node in targets(cfg):
        if groups is None or path.split(".")[0] in groups:
            problems += node_problems(path, node, node._target_)
    for path, (target, given) in KWARGS_NODES.items():
        if isinstance(cfg.get(path), DictConfig):
            problems += node_problems(path, cfg[path], target, given)
    return problems


def targets(node, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """(dotted path, node) of every config node with a `_target_`."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for k in node:
            yield from targets(node._get_node(k), f"{path}.{k}" if path else str(k))


def signature_of(target: str) -> tuple[inspect.Signature, dict]:
    """Signature and resolved type hints ({} when they do not resolve) of a target function or class."""
    fn = get_method(target)
    fn = fn.__init__ if inspect.isclass(fn) else fn
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation naming something not importable here
        hints = {}
    return inspect.signature(fn), hints


def node_problems(path: str, node: DictConfig, target: str, given: set[str] = frozenset()) -> list[str]:
    """Keys of `node` that `target` does not take, and values of the wrong type."""
    try:
        sig, hints = signature_of(target)
    except (ImportError, AttributeError, ValueError) as e:
        return [f"{path}._target_={target} cannot be imported ({e})."]
    params = {n: p for n, p in sig.parameters.items() if n != "self" and n not in given}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keys = [str(k) for k in node if not str(k).startswith("_")]
    if path == "model":
        keys = [k for k in keys if k not in MODEL_KEYS_FOR_OTHER_GROUPS]
    problems = []
    for key in keys:
        where = f"{path}.{key}" if path else key
        if key not in params:
            if not takes_any:
                close = difflib.get_close_matches(key, list(params), n=1, cutoff=0.6)
                hint = f"did you mean {path}.{close[0]}?" if close else f"it takes {', '.join(params)}."
                problems.append(f"{where}: {target} has no argument {key!r}; {hint}")
            continue
        try:
            value = node[key]
        except OmegaConfBaseException as e:
            problems.append(f"{where}: {str(e).splitlines()[0]}")
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if isinstance(value, dict) and "_target_" in value:
            continue  # a nested target: checked as a node of its own
        hint = hints.get(key)
        if hint is None or value is None or fits(value, hint):  # null: the code's default or fill-in
            continue
        problems.append(f"{where}={value} is not a valid value: {target} takes {key}: {type_name(hint)}.")
    return problems


def fits(value, tp) -> bool:
    """Whether a config value (plain Python: None, bool, int, float, str, list, dict) can be an argument of type
    `tp`. Classes other than the plain types cannot be checked from a config value and always fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args and type(value) in {type(a) for a in args}
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp in (str, Path, os.PathLike):
        return isinstance(value, str)
    if origin in SEQUENCES or tp in SEQUENCES:
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(fits(v, args[0]) for v in value)
    if origin in (dict, abc.Mapping, abc.MutableMapping) or tp in (dict, abc.Mapping):
        return isinstance(value, dict)
    return True


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if tp is type(None):
        return "null"
    return str(tp).removeprefix("typing.") if origin else getattr(tp, "__name__", str(tp))


def device_problems(key: str, accelerator, devices=None) -> list[str]:
    """An accelerator this machine lacks: `gpu`/`cuda` without a CUDA device (or fewer than `devices`), `mps`."""
    name = str(accelerator).lower()
    if name in ("gpu", "cuda") or name.startswith("cuda:"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        if n == 0:
            return [
                f"{key}={accelerator}, but torch {torch.__version__} ({build}) sees no CUDA GPU on this machine; "
                f"use {key}={'auto' if key == 'device' else 'cpu'}, or run where a GPU is (CUDA torch: README)."
            ]
        if isinstance(devices, int) and devices > n:
            return [
                f"trainer.devices={devices}, but this machine has {n} CUDA GPU(s); use trainer.devices={n}."
            ]
    if name == "mps" and not torch.backends.mps.is_available():
        return [f"{key}=mps, but Apple's MPS is not available here; use {key}=cpu."]
    return []


def check_checkpoint_fits(checkpoint: dict, state: dict[str, torch.Tensor], config: dict | None) -> None:
    """Before Lightning loads a checkpoint into this run's module (state_dict `state`, resolved `config`): if its
    weights do not fit, say which model and settings it was trained with (a ConfigError)."""
    saved = checkpoint.get("state_dict") or {}
    if saved.keys() == state.keys() and all(saved[k].shape == state[k].shape for k in state):
        return
    was, now = checkpoint.get("config") or {}, config or {}
    refuse_other_model(was, now)
    raise ConfigError(
        "This checkpoint's weights do not fit the model you asked for ("
        + ("; ".join(model_differences(was, now)) or "other parameter names or shapes")
        + "). Resume with the checkpoint's settings, or start a new run without ckpt_path."
    )


def model_differences(was: dict, now: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The backbone.* and model.* options (but the "group.key" names in `ignore`) where a checkpoint's resolved
    run config `was` and this run's `now` differ, as "group.key: a in the checkpoint, b now"."""
    return [
        f"{group}.{k}: {a} in the checkpoint, {b} now"
        for group in ("backbone", "model")
        for k in sorted(set(was.get(group) or {}) | set(now.get(group) or {}))
        if (a := (was.get(group) or {}).get(k)) != (b := (now.get(group) or {}).get(k))
        and f"{group}.{k}" not in ignore
    ]


def refuse_other_model(was: dict, now: dict) -> None:
    """A checkpoint's run config `was` and this run's `now` must build the same kind of model."""
    a, b = model_option(was), model_option(now)
    if a != b:
        raise ConfigError(
            f"This checkpoint is a model={a} checkpoint; you asked for model={b}. "
            f"Resume it with model={a}, or start a new run without ckpt_path."
        )


def model_option(config: dict) -> str:
    """The configs/model/ option whose `_target_` builds a run config's model (else the target itself)."""
    target = (config.get("model") or {}).get("_target_", "?")
    for path in sorted((Path(__file__).parents[1] / "configs" / "model").glob("*.yaml")):
        if OmegaConf.load(path).get("_target_") == target:
            return path.stem
    return target
