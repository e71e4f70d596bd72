"""Builders: turn a composed Hydra config into a ready run (tokenizer, data, backbone, model, module, trainer).

Shared by train.py and evaluate.py; classes never see the config, only the flat arguments of their builders.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate as hydra_instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict

from callbacks.checkpoint import AtomicCheckpointIO, load_checkpoint, model_weights
from data.heap import keep_freed_memory
from models.config_checks import MODEL_KEYS_FOR_OTHER_GROUPS, check_config, model_differences
from models.config_errors import ConfigError, MissingFileError
from models.errors import UserError
from models.lit_module import LitModule

log = logging.getLogger(__name__)
# model options that change how a model trains (gradients, memory use), not what it computes
TRAINING_ONLY_OPTIONS = ("model.k2", "model.checkpoint_segments")


def instantiate(cfg, *args, **kwargs):
    """hydra.utils.instantiate, re-raising our own errors unwrapped so the user sees the message that names the fix."""
    try:
        return hydra_instantiate(cfg, *args, **kwargs)
    except InstantiationException as e:
        if isinstance(
            e.__cause__, (UserError, MisconfigurationException, ValueError, FileNotFoundError, ImportError)
        ):
            raise e.__cause__ from None
        raise


def auto_precision(accelerator: str = "auto") -> str:
    """bf16-mixed autocast on a CUDA device with bf16 (16-mixed on older ones); fp32 on a CPU."""
    if (accelerator in ("auto", "gpu") or accelerator.startswith("cuda")) and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def required(what: str):
    """`${required:'key=... , what it is'}`: a value an experiment cannot run without (OmegaConf's ??? does not
    survive being merged onto a default); the command line replaces it, and reading it unreplaced is an error."""
    raise ConfigError(f"this experiment needs {what} on the command line")


def register_resolvers() -> None:
    for name, resolver in (("auto_precision", auto_precision), ("required", required)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


def build_backbone(cfg: DictConfig, tokenizer) -> torch.nn.Module:
    """Instantiate the backbone; a null vocab_size takes the tokenizer's; a vocabulary smaller than the
    tokenizer's is refused (token ids would index past the embedding)."""
    cfg = cfg.copy()
    if "vocab_size" in cfg and cfg.vocab_size is None:
        with open_dict(cfg):
            cfg.vocab_size = tokenizer.vocab_size
    backbone = instantiate(cfg)
    if backbone.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"Tokenizer/vocabulary mismatch: tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the "
            f"backbone's vocabulary has {backbone.vocab_size}. Set backbone.vocab_size={tokenizer.vocab_size} "
            "(or null to follow the tokenizer), or pick the tokenizer the backbone was trained with."
        )
    return backbone


def load_backbone_init(backbone: torch.nn.Module, path: str, backbone_cfg: DictConfig | None = None) -> None:
    """Start from backbone weights saved by `python -m models.pretrain_babi` (`backbone_init=<file>`). With
    `backbone_cfg` (this run's), the config saved with the weights must agree: options that change no shape
    (e.g. alibi, rope_theta) would otherwise load silently into a different model."""
    if not Path(path).is_file():
        raise MissingFileError(
            f"backbone_init={path} does not exist. Give an existing file, backbone_init=warm_start (BABILong "
            f"tasks: trained once and cached), or backbone_init=null for random weights."
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if backbone_cfg is not None:
        was, now = saved["backbone"], OmegaConf.to_container(backbone_cfg, resolve=True)
        off = (None, False)  # what an option the file predates counts as
        differ = {k: (was.get(k), v) for k, v in now.items() if (was[k] != v if k in was else v not in off)}
        if differ:
            listed = ", ".join(f"{k}: {a} in the file, {b} now" for k, (a, b) in differ.items())
            raise ConfigError(
                f"backbone_init={path} was trained for another backbone ({listed}); re-create it with "
                f"`python -m models.pretrain_babi <this run's overrides>`."
            )
    try:
        backbone.load_state_dict(saved["state_dict"])
    except RuntimeError as e:
        raise ConfigError(
            f"backbone_init={path} does not fit this backbone; re-create it with this run's backbone= options.\n{e}"
        ) from None


def load_init_from(model: torch.nn.Module, path: str, config: dict | None = None) -> None:
    """Start a new run from the task-model weights of a checkpoint (`init_from=<ckpt>`): step 0, this run's config
    (curriculum, optimizer, steps); the model must be the same (type, shapes). With `config` (this run's, resolved),
    backbone / model options that differ from the checkpoint's without changing a shape (ARMT's use_denom, alibi,
    ...) are named in a warning: the weights load, but compute differently. Options of training alone (truncated
    BPTT's k2, checkpointing) are not: a longer curriculum stage may well change them."""
    checkpoint = load_checkpoint(path)
    try:
        model.load_state_dict(model_weights(checkpoint, path))
    except RuntimeError as e:
        was = (checkpoint.get("config") or {}).get("model", {}).get("_target_", "?")
        raise ConfigError(
            f"init_from={path} holds another model ({was}) than this run's {type(model).__name__} or other shapes: "
            f"give the same model= and backbone= options as that run.\n{e}"
        ) from None
    differ = model_differences(checkpoint.get("config") or {}, config or {}, ignore=TRAINING_ONLY_OPTIONS)
    if differ:
        log.warning(
            "init_from=%s was trained with other model options (%s): its weights load, but compute differently "
            "here; give the same options to continue that model.",
            path,
            "; ".join(differ),
        )


def build_model(cfg: DictConfig, tokenizer, backbone_init: str | None = None) -> torch.nn.Module:
    """Backbone (from `backbone_init` weights when given: train.py's start) wrapped by the task model of
    `cfg.model` (CausalLM, RMT, RMT-R, Llama-XL)."""
    model_cfg = {k: v for k, v in cfg.model.items() if k not in MODEL_KEYS_FOR_OTHER_GROUPS}
    if backbone_init == "warm_start":
        from models.pretrain_babi import warm_start  # it builds backbones with this module

        backbone_init = str(warm_start(cfg, tokenizer))
    backbone = build_backbone(cfg.backbone, tokenizer)
    if backbone_init:
        load_backbone_init(backbone, backbone_init, cfg.backbone)
    return instantiate(OmegaConf.create(model_cfg), _partial_=True)(backbone=backbone)


def set_threads(threads: int | None, model: torch.nn.Module, cuda: bool) -> None:
    """CPU threads for a run on the CPU (`cuda`: none set): `threads`, else one for tiny models (fastest on small
    CPUs, and two runs side by side share the cores) and every core for big ones."""
    if cuda:
        return
    n_params = sum(p.numel() for p in model.parameters())
    torch.set_num_threads(threads or (1 if n_params < 20_000_000 else os.cpu_count()))
    keep_freed_memory()


@dataclass
class Run:
    tokenizer: object
    datamodule: L.LightningDataModule
    module: LitModule
    trainer: L.Trainer


def build_callbacks(cfg: DictConfig, datamodule) -> list:
    callbacks = []
    for name, c in (cfg.get("callbacks") or {}).items():
        if "_target_" not in c:  # e.g. an experiment's callbacks.forgetting_curve.* after callbacks=default
            raise ConfigError(
                f"callbacks.{name} sets options of a callback that the chosen callbacks group does not have; "
                f"drop them with ~callbacks.{name}, or pick a callbacks group that has it."
            )
        if name == "progress_bar" and not (
            cfg.trainer.get("enable_progress_bar", True) and sys.stdout.isatty()
        ):
            continue  # no bar in a log file: callbacks.progress.ProgressLog writes plain lines instead
        if name == "model_checkpoint" and c.get("monitor") is None:
            monitor, mode = getattr(datamodule, "monitor", ("val/loss", "min"))
            c = OmegaConf.merge(c, {"monitor": monitor, "mode": mode})
        callbacks.append(instantiate(c))
    callbacks += list(getattr(datamodule, "callbacks", lambda: [])())
    return callbacks


def build_run(cfg: DictConfig) -> Run:
    check_config(cfg)
    init_from = None if cfg.get("ckpt_path") else cfg.get("init_from")  # a resume restores its own weights
    L.seed_everything(cfg.seed, workers=True)
    tokenizer = instantiate(cfg.tokenizer)
    corpus = instantiate(cfg.corpus)
    datamodule = instantiate(cfg.task, _partial_=True)(tokenizer=tokenizer, corpus=corpus)
    model = build_model(cfg, tokenizer, None if init_from else cfg.get("backbone_init"))
    # the resolved config: checked against init_from's, saved in every checkpoint, logged as hyperparameters
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if init_from:
        load_init_from(model, init_from, resolved)
    if cfg.get("compile"):
        model.backbone.compile()  # in place: module names, state dict and checkpoints stay as without it
    n_params = sum(p.numel() for p in model.parameters())
    cuda = cfg.trainer.accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    set_threads(cfg.get("threads"), model, cuda)
    log.info("model: %s, %.2fM parameters", type(model).__name__, n_params / 1e6)
    print(f"Parameters: {n_params:,} ({n_params / 1e6:.1f}M)")
    module = LitModule(
        model,
        instantiate(cfg.loss),
        **cfg.optim,
        config=resolved,
    )
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    callbacks = build_callbacks(cfg, datamodule)
    trainer = instantiate(
        cfg.trainer,
        logger=loggers or False,
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
    )
    for lg in loggers:
        lg.log_hyperparams(resolved)
    log.info("Run folder: %s", Path(cfg.run_dir).resolve())
    return Run(tokenizer, datamodule, module, trainer)
