"""A run's config: what a fresh run, a resumed run, and a checkpoint rebuilt by evaluate.py are made from.

- A fresh run (`ckpt_path=null`) gets a new `run_id` and refuses a run_dir that already holds checkpoints: a run
  folder holds one run, so `ckpt_path=last` always means that run's newest state.
- A resume (`ckpt_path=last` or a file) continues the config saved in its checkpoint and applies only the overrides
  given on the command line; changes to the model, optimizer or seed are logged as a warning. A run_dir given anew
  (e.g. the folder was moved) takes the run's paths with it.
- A checkpoint's config may only name the builders that configs/ names (`_target_`): loading a checkpoint must not
  run anyone's code.
- `run_dir/.hydra/config.yaml` (and `overrides.yaml`) record the config of the run's latest start; they are written
  once the run is built, so a refused or failed start leaves them alone.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from callbacks.checkpoint import KEPT_DIR, MissingCheckpointError, load_checkpoint
from models.config_checks import refuse_other_model
from models.errors import UserError

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WATCHED = ("tokenizer", "backbone", "model", "optim", "seed")  # a resume that changes these gets a warning
ABSENT = object()


class RunDirInUseError(UserError):
    pass


class UnsafeTargetError(UserError):
    pass


# ---- a checkpoint's config --------------------------------------------------------------------------------------
@functools.cache
def allowed_targets() -> frozenset[str]:
    """Every `_target_` that a file of configs/ names: the only callables a checkpoint's config may instantiate."""
    pattern = re.compile(r"^\s*_target_:\s*([\w.]+)", re.MULTILINE)
    return frozenset(t for path in CONFIGS.rglob("*.yaml") for t in pattern.findall(path.read_text()))


# `_target_`s that configs/ named in earlier versions -> what replaced them: older checkpoints keep loading
RENAMED_TARGETS = {"lightning.pytorch.callbacks.RichProgressBar": "callbacks.progress.StepProgressBar"}


def renamed_targets(node):
    """`node` (a plain container) with every retired `_target_` replaced by its successor."""
    if isinstance(node, dict):
        node = {k: renamed_targets(v) for k, v in node.items()}
        if node.get("_target_") in RENAMED_TARGETS:
            node["_target_"] = RENAMED_TARGETS[node["_target_"]]
        return node
    if isinstance(node, list):
        return [renamed_targets(v) for v in node]
    return node


def check_targets(node, source, where: str = "") -> None:
    """Refuse any `_target_` in `node` (a plain, resolved container) that configs/ does not name."""
    if isinstance(node, dict):
        if "_target_" in node and node["_target_"] not in allowed_targets():
            raise UnsafeTargetError(
                f"{source} names _target_ {node['_target_']!r} (at {where or 'the root'}), which is not a builder of "
                "this project (the _target_s of configs/); refusing to instantiate it. Only use checkpoints you trust."
            )
        for k, v in node.items():
            check_targets(v, source, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            check_targets(v, source, f"{where}[{i}]")


def checkpoint_config(checkpoint: dict, path: str | Path) -> DictConfig:
    """The resolved training config a checkpoint carries, every `_target_` checked against configs/."""
    if not isinstance(checkpoint.get("config"), dict):
        raise ValueError(
            f"{path} holds no training config (checkpoint['config']): it was not written by this framework's "
            "train.py. Evaluate a pretrained model with backbone=... instead."
        )
    config = renamed_targets(OmegaConf.to_container(OmegaConf.create(checkpoint["config"]), resolve=True))
    check_targets(config, f"Checkpoint {path}")
    return OmegaConf.create(config)


# ---- starting and resuming ----------------------------------------------------------------------------------------
def resolve_ckpt_path(ckpt_path: str | None, run_dir: str) -> Path | None:
    """`last` -> run_dir/checkpoints/last.ckpt (resume); a path must exist; None starts fresh."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        path = Path(run_dir) / "checkpoints" / "last.ckpt"
        if not path.is_file():
            raise MissingCheckpointError(
                f"ckpt_path=last but {path} does not exist. Resume with the run's folder: run_dir=<old run dir> "
                "ckpt_path=last, or give a checkpoint file: ckpt_path=/path/to/file.ckpt"
            )
        return path
    if not Path(ckpt_path).is_file():
        raise MissingCheckpointError(
            f"Checkpoint not found: {ckpt_path}. Give an existing .ckpt file, or ckpt_path=last with run_dir=<the run>."
        )
    return Path(ckpt_path)


def prepare_run(cfg: DictConfig, overrides: list[str] | None) -> tuple[DictConfig, str | None]:
    """The config to build and the checkpoint to resume from (None: a fresh run).

    `overrides`: the command line's; a resume applies them to the checkpoint's saved config. None: `cfg` is the
    complete config (programmatic use), also when resuming."""
    path = resolve_ckpt_path(cfg.ckpt_path, cfg.run_dir)
    if path is None:
        refuse_used_run_dir(cfg, None)
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.run_id = uuid.uuid4().hex[:12]
        return cfg, None
    # a missing, corrupt or unsafe checkpoint fails here, before anything is built
    saved = checkpoint_config(load_checkpoint(path), path)
    resumed = cfg.copy() if overrides is None else apply_overrides(saved, cfg, overrides)
    refuse_other_model(OmegaConf.to_container(saved), OmegaConf.to_container(resumed))
    with open_dict(resumed):
        resumed.run_id = saved.get("run_id") or uuid.uuid4().hex[:12]
    refuse_used_run_dir(resumed, path)
    changed = changes(saved, resumed)
    if changed:
        log.warning(
            "Resuming from %s with changes to the model, optimizer or seed, which apply from its step on: %s",
            path,
            "; ".join(changed),
        )
    return resumed, str(path)


def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(
        OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath") or Path(cfg.run_dir) / "checkpoints"
    )


def refuse_used_run_dir(cfg: DictConfig, resume_from: Path | None) -> None:
    """A run_dir with checkpoints belongs to their run: only a resume from one of them may continue there."""
    folder = checkpoint_dir(cfg)
    found = sorted(p.name for p in [*folder.glob("*.ckpt"), *(folder / KEPT_DIR).glob("*.ckpt")])
    if not found or (resume_from is not None and folder.resolve() in resume_from.resolve().parents):
        return
    start = "A new run" if resume_from is None else f"A resume from {resume_from}"
    raise RunDirInUseError(
        f"{start} cannot use run_dir={cfg.run_dir}: it holds the checkpoints of another run ({', '.join(found[:4])}). "
        f"Resume that run with `python train.py run_dir={cfg.run_dir} ckpt_path=last` (its saved config; add only "
        "what changes, e.g. trainer.max_steps=...), or give this run another run_dir."
    )


def apply_overrides(saved: DictConfig, composed: DictConfig, overrides: list[str]) -> DictConfig:
    """The saved config with what each override names taken from `composed` (the defaults with the overrides):
    `key=value` a key, `group=option` the group's node, `~key` deletes. Keys new to the configs since the run
    started come from `composed` too. A run_dir given anew moves every path under the saved one."""
    cfg = saved.copy()
    for key in set(composed) - set(saved):
        cfg[key] = composed[key]
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra":
            continue
        if o.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if isinstance(node, DictConfig) and leaf in node:
                del node[leaf]
            continue
        node = OmegaConf.select(composed, key, default=ABSENT)
        if node is ABSENT:
            log.warning(
                "%s is not applied to a resumed run: the run's saved config already holds what it set. Override "
                "single keys instead (e.g. trainer.max_steps=...).",
                o.input_line,
            )
            continue
        OmegaConf.update(cfg, key, node, merge=False, force_add=True)
    if str(saved.run_dir) != str(cfg.run_dir):
        cfg = OmegaConf.create(
            moved(OmegaConf.to_container(cfg), str(saved.run_dir).rstrip("/"), str(cfg.run_dir))
        )
    OmegaConf.set_struct(cfg, True)
    return cfg


def moved(node, old: str, new: str):
    """`node` with every string path at or under `old` moved to `new`."""
    if isinstance(node, dict):
        return {k: moved(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [moved(v, old, new) for v in node]
    if isinstance(node, str) and (node == old or node.startswith(old + "/")):
        return new + node[len(old) :]
    return node


def changes(saved: DictConfig, resumed: DictConfig) -> list[str]:
    """`key: saved -> resumed` for every changed leaf of the WATCHED parts of the config."""
    a, b = (
        flat({k: v for k, v in OmegaConf.to_container(c, resolve=True).items() if k in WATCHED})
        for c in (saved, resumed)
    )
    return [f"{k}: {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


@rank_zero_only
def save_run_config(cfg: DictConfig, overrides: list[str] | None) -> None:
    """Record the config of this start in run_dir/.hydra/ (config.yaml; overrides.yaml: the command line)."""
    folder = Path(cfg.run_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    if overrides is not None:
        (folder / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
