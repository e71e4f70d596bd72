"""Evaluate any checkpoint of the framework (or a pretrained model), watch a training run, or export to Hugging Face.

    python evaluate.py ckpt_path=RUN/checkpoints/last.ckpt eval=[ppl,babilong]
    python evaluate.py watch=RUN_DIR eval=[ppl]             # every new checkpoint of a (running) training run
    python evaluate.py backbone=smollm2_135m eval=[ppl]     # a pretrained model, no checkpoint
    python evaluate.py export=hf ckpt_path=RUN/checkpoints/last.ckpt
    python evaluate.py compare=[A.ckpt,B.ckpt] eval=[ppl,longppl,forgetting_curve] out_dir=docs/x  # side by side

A checkpoint carries its resolved training config (`checkpoint["config"]`; only the `_target_`s of configs/ are
accepted, models/run_config.py): tokenizer and model are rebuilt from it with `models.builders.build_model` and its
`model.`-prefixed weights loaded. Evaluators are the entries of
`configs/eval/` (protocol: `fn(model, tokenizer, corpus, out_dir, **flat_args) -> {metric: float}`, model in eval
mode; see `ppl` and `babilong` below). Results go to `<ckpt>.eval/<evaluator>/` (JSON, CSV, PNG; with window=W to
`<ckpt>.window<W>.eval/`) and
`<ckpt>.eval/metrics.json`; each metric is logged as `eval/<metric>` at the checkpoint's global step, to CSV
(`RUN_DIR/eval/version_N/metrics.csv`) and to the training run's own W&B run (its id read from `RUN_DIR/wandb`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import hydra
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf
from torch import nn

from callbacks.babilong_eval import plot_accuracy_heatmap
from callbacks.checkpoint import evaluated_checkpoint, load_checkpoint, model_weights
from callbacks.comparison import EvaluatedModel, compare
from callbacks.progress import track
from callbacks.wandb_logger import build_wandb_logger
from callbacks.watch import results_dir, state_digest, watch, write_json
from data.corpus import Corpus, tokenize_corpus
from data.lm_datamodule import with_specials
from data.tokenizer import Tokenizer
from models import cli
from models.builders import auto_precision, build_model, register_resolvers, set_threads
from models.config_checks import check_config
from models.config_errors import ConfigError, MissingFileError
from models.lit_module import exact_match
from models.run_config import checkpoint_config
from models.streaming import token_logprobs

log = logging.getLogger("evaluate")
register_resolvers()
DEFAULT_CORPUS = {"_target_": "data.corpus.load_corpus", "kind": "sotu"}


# ---- evaluators ---------------------------------------------------------------------------------------
@torch.no_grad()
def ppl(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    out_dir: Path,
    split: str = "test",
    max_len: int = 4096,
    max_docs: int | None = None,
) -> dict[str, float]:
    """Held-out perplexity: each document `[bos] text [eos]` of `split`, cut to `max_len` tokens, streamed through
    `model.iter_logits` (models.streaming.token_logprobs); token-weighted over all documents. Writes ppl.json."""
    tokens = tokenize_corpus(corpus, tokenizer)[split]
    docs = with_specials(tokens, tokenizer.bos_id, tokenizer.eos_id)[:max_docs]
    if not docs:
        raise ConfigError(
            f"The {split!r} split of corpus {corpus.name!r} has no documents; pick another split."
        )
    device = next(model.parameters()).device
    rows, nll_sum, n_tokens = [], 0.0, 0
    for name, doc in track(list(zip(tokens.names, docs, strict=False)), f"ppl ({split})"):
        ids = torch.from_numpy(doc[:max_len]).to(device)[None]  # (1, T)
        nll = -token_logprobs(model, ids)[0, 1:].double()  # (T - 1,): index 0 has no prediction
        nll_sum, n_tokens = nll_sum + nll.sum().item(), n_tokens + nll.numel()
        rows.append({"document": name, "n_tokens": nll.numel(), "ppl": math.exp(nll.mean().item())})
    loss = nll_sum / n_tokens
    result = {"ppl": math.exp(loss), "ppl/loss": loss}
    summary = {"split": split, "max_len": max_len, "n_tokens": n_tokens, **result, "documents": rows}
    write_json(Path(out_dir) / "ppl.json", summary)
    return result


@torch.no_grad()
def babilong(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    out_dir: Path,
    tasks: tuple[str, ...] | None = None,
    lengths: tuple[int, ...] = (0, 1024, 2048, 4096),
    n: int = 100,
    batch_size: int = 8,
    seed: int = 0,
    official: str | None = None,
    answer_prompt: str = "Answer:",
    memory: str = "carried",
    early_facts: bool = False,
) -> dict[str, float]:
    """BABILong exact-match accuracy over tasks (None: qa1-qa5; of a checkpoint: the task it was trained on,
    `checkpoint_task`) x context lengths (0 = facts only): `n` test samples per cell with
    background from the corpus' test split (or the `official` RMT-team/babilong data). Writes babilong.json and
    the heat map heatmap.png (with the cells of an earlier run of the same weights and settings: `merged_cells`);
    returns this run's `babilong/<task>/acc@<length>` and `babilong/acc` (mean over them).

    memory="reset": the ablation of a memory model (RMT, RMT-R, ARMT): its memory is reset every segment, so facts
    before the question's segment are out of reach; writes babilong_reset.json, heatmap_reset.png and returns
    `babilong_reset/...`. memory="latest": RMT-R retrieves from its latest memory state alone, the one RMT reads
    (the ablation of its retrieval over past states; `babilong_latest/...`). early_facts=True keeps only samples
    whose facts all lie before the memory model's last segment (the question's), so that the answer must come
    through memory (`babilong[_reset|_latest]_early_facts/...`)."""
    from data.babilong import batch_to, length_name
    from data.curriculum import BabilongDataModule

    if memory not in ("carried", "reset", "latest"):
        raise ConfigError(
            f"eval.babilong.memory={memory}: use carried (the model as trained), reset or latest (ablations)."
        )
    reset, latest = memory == "reset", memory == "latest"
    if latest and not hasattr(model, "retrieving_latest"):
        raise ConfigError(
            f"eval.babilong.memory=latest limits RMT-R's retrieval to its latest memory state; {type(model).__name__} "
            "does not retrieve. Use an RMT-R checkpoint, or memory=carried / reset."
        )
    if reset and "recurrent" not in inspect.signature(model.forward).parameters:
        raise ConfigError(
            f"eval.babilong.memory=reset resets a memory model's memory every segment; {type(model).__name__} has no "
            "memory to reset. Use an RMT, RMT-R or ARMT checkpoint, or memory=carried."
        )
    if early_facts and (official or not hasattr(model, "segment_bounds")):
        raise ConfigError(
            "eval.babilong.early_facts=true needs a memory model (RMT, RMT-R, ARMT: it has segments) and generated "
            "samples (official=null): it keeps the samples whose facts all precede the last segment."
        )
    if early_facts and 0 in lengths:
        raise ConfigError(
            "eval.babilong.early_facts=true with length 0: the facts alone are one segment, with nothing before it. "
            "Drop 0 from eval.babilong.lengths."
        )
    name = "babilong" + {"carried": ""}.get(memory, f"_{memory}") + ("_early_facts" if early_facts else "")
    device = next(model.parameters()).device
    settings = dict(seed=seed, official=official, answer_prompt=answer_prompt, memory=memory)
    settings |= dict(early_facts=early_facts, weights=state_digest({"state_dict": model.state_dict()}))
    new: dict[str, dict[str, dict]] = {"accuracy": {}, "samples": {}}  # {task: {length: value}} each
    for task in tasks or ("qa1", "qa2", "qa3", "qa4", "qa5"):
        data = BabilongDataModule(
            tokenizer,
            corpus,
            task=task,
            n_test=n * EARLY_FACTS_TRIES if early_facts else n,
            test_lengths=lengths,
            eval_batch_size=batch_size,
            eval_seed=seed,
            official=official,
            answer_prompt=answer_prompt,
        )
        loaders = [early_facts_loader(data, model, length, n) for length in lengths] if early_facts else None
        for length, loader in zip(lengths, loaders or data.test_dataloader(), strict=True):
            hits, total = 0.0, 0
            for batch in track(loader, f"babilong {task} @ {length_name(length)}"):
                batch = batch_to(batch, device)
                with model.retrieving_latest() if latest else contextlib.nullcontext():
                    out = model(batch, recurrent=False) if reset else model(batch)
                hits += exact_match(out.logits, out.targets, batch).sum().item()
                total += len(batch["input_ids"])
            new["accuracy"].setdefault(task, {})[length_name(length)] = hits / total
            new["samples"].setdefault(task, {})[length_name(length)] = total
    saved = merged_cells(Path(out_dir) / f"{name}.json", settings, new)
    write_json(Path(out_dir) / f"{name}.json", settings | saved)
    counts = sorted({c for row in saved["samples"].values() for c in row.values()})
    many = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    notes = [", memory reset every segment"] * reset + [", retrieval from the latest state only"] * latest
    notes += [", facts before the last segment"] * early_facts
    plot_accuracy_heatmap(
        saved["accuracy"],
        Path(out_dir) / f"heatmap{name.removeprefix('babilong')}.png",
        title=f"BABILong accuracy ({many} samples a cell{''.join(notes)})",
    )
    metrics = {f"{name}/{t}/acc@{s}": acc for t, row in new["accuracy"].items() for s, acc in row.items()}
    return metrics | {f"{name}/acc": sum(metrics.values()) / len(metrics)}


def merged_cells(path: Path, settings: dict, new: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """The tables `new` ({"accuracy": {task: {length: acc}}, "samples": ...}) over those of an earlier evaluation in
    `path` with the same settings and weights, so a slow column (1M tokens, fewer samples) can be added later; an
    earlier file of other settings or weights is replaced."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if {k: old.get(k) for k in settings} != settings:
        return new
    for name, table in new.items():
        for task, row in table.items():
            old[name].setdefault(task, {}).update(row)
    return {name: old[name] for name in new}


EARLY_FACTS_TRIES = 100  # early_facts: candidates per kept sample at most


def early_facts_loader(data, model: nn.Module, length: int, n: int) -> torch.utils.data.DataLoader:
    """The first `n` test samples of `data` (a BabilongDataModule) with `length` context tokens whose facts all lie
    before the model's last segment, batched as `data.test_dataloader()` batches them."""
    from callbacks.memory_maps import fact_segments_of
    from data.babilong import length_name

    dataset, kept = data.test_set(length), []
    for i in range(len(dataset)):
        ends, n_segments = fact_segments_of(dataset, i, model)
        if max(ends) < n_segments:
            kept.append(i)
            if len(kept) == n:
                break
    if len(kept) < n:
        raise ConfigError(
            f"Only {len(kept)} of {len(dataset)} {data.task} samples at {length_name(length)} have every fact before "
            f"the last segment; ask for fewer (eval.babilong.n) or longer contexts."
        )
    return data.eval_loader(torch.utils.data.Subset(dataset, kept), length=length)


@torch.no_grad()
def memory_maps(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    out_dir: Path,
    task: str = "qa1",
    length: int = 2048,
    n_samples: int = 2,
    n_stats: int = 50,
    seed: int = 0,
) -> dict[str, float]:
    """Figure 10 of Kuratov et al. 2024 for a memory model (RMT, RMT-R, ARMT) on BABILong test samples of `length`
    context tokens: memory_maps.png draws the first `n_samples` (distances of memory states, the states after a
    fact dotted; write/read attention). Over the first `n_stats` samples it measures whether memory changes at the
    facts: `move_ratio_at_facts`, the mean ||M_t - M_{t-1}|| of segments holding a fact over that of background
    segments, and `top_move_at_fact`, the share of samples whose largest move is at a fact segment (the first
    segment, whose move from M_0 every sample makes, is left out of both); by chance it would be
    `fact_segment_share`, the share of segments that hold a fact."""
    from callbacks.memory_maps import fact_segments, memory_figure, memory_moves, memory_panels, memory_states
    from data.babilong import length_name
    from data.curriculum import BabilongDataModule
    from models.rmt import RMT

    if not isinstance(model, RMT):
        raise ConfigError(
            f"eval=[memory_maps] draws the memory of RMT, RMT-R or ARMT; got {type(model).__name__}."
        )
    n = max(n_samples, n_stats)
    dataset = BabilongDataModule(tokenizer, corpus, task=task, n_test=n, eval_seed=seed).test_set(length)
    device = next(model.parameters()).device
    panels, at_fact, elsewhere, top, share = [], [], [], [], []
    for i in track(range(len(dataset)), f"memory maps {task} @ {length_name(length)}"):
        ids = dataset[i].input_ids
        bounds = model.segment_bounds(len(ids))
        facts = fact_segments(ids, dataset.tasks.facts[dataset.indices[i]], bounds)
        ids = torch.from_numpy(ids).to(device)
        if i < n_samples:
            panels.append(memory_panels(model, ids, facts=tuple(facts)))
        if i < n_stats and len(bounds) > 1:
            moves = memory_moves(memory_states(model, ids)).cpu()
            is_fact = torch.zeros(len(moves), dtype=torch.bool)
            is_fact[torch.tensor(facts) - 1] = True
            moves, is_fact = moves[1:], is_fact[1:]
            at_fact.append(moves[is_fact])
            elsewhere.append(moves[~is_fact])
            top.append(bool(is_fact[moves.argmax()]) if is_fact.any() else False)
            share.append(float(is_fact.float().mean()))
    memory_figure(panels).savefig(Path(out_dir) / "memory_maps.png", dpi=100)
    metrics = {"memory_maps/segments": len(model.segment_bounds(len(dataset[0].input_ids)))}
    if at_fact:
        background = torch.cat(elsewhere)
        metrics |= {
            "memory_maps/move_ratio_at_facts": float(torch.cat(at_fact).mean() / background.mean())
            if len(background)
            else float("nan"),
            "memory_maps/top_move_at_fact": sum(top) / len(top),
            "memory_maps/fact_segment_share": sum(share) / len(share),  # top_move_at_fact by chance
        }
    write_json(Path(out_dir) / "memory_maps.json", {"task": task, "length": length, "seed": seed} | metrics)
    return metrics


# ---- running evaluators -------------------------------------------------------------------------------
def evaluate_model(
    model: nn.Module,
    tokenizer: Tokenizer,
    corpus: Corpus,
    evaluators: Mapping,
    out_dir: Path,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Run each evaluator config (`{name: {_target_, **flat_args}}`) into `out_dir/<name>/`, the model in eval mode
    under `context()` (e.g. autocast). Returns metrics `eval/<metric>` and images `eval/<name>/<png stem>`."""
    if not evaluators:
        raise ConfigError("No evaluator selected: give eval=[ppl,babilong,...] (the files of configs/eval/).")
    metrics, images = {}, {}
    was_training = model.training
    model.eval()
    try:
        for name, node in evaluators.items():
            fn = instantiate(node, _partial_=True, _convert_="all")
            folder = Path(out_dir) / name
            folder.mkdir(parents=True, exist_ok=True)
            with context(), torch.no_grad():
                result = fn(model, tokenizer, corpus, folder)
            if not isinstance(result, Mapping):
                raise TypeError(
                    f"Evaluator {name!r} must return a dict of scalar metrics, got {type(result)}"
                )
            metrics |= {f"eval/{k}": float(v) for k, v in result.items()}
            images |= {f"eval/{name}/{p.stem}": [str(p)] for p in sorted(folder.glob("*.png"))}
    finally:
        model.train(was_training)
    return metrics, images


def log_results(
    loggers: list[Logger], metrics: dict[str, float], images: dict[str, list[str]], step: int
) -> None:
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        if hasattr(logger, "log_image"):
            for key, paths in images.items():
                logger.log_image(key, paths, step=step)
        logger.save()


def write_results(out_dir: Path, ckpt: str | None, step: int, metrics: dict[str, float]) -> None:
    write_json(Path(out_dir) / "metrics.json", {"checkpoint": ckpt, "global_step": step, "metrics": metrics})


# ---- checkpoints ----------------------------------------------------------------------------------------
def build_from_checkpoint(checkpoint: dict, path: str | Path) -> tuple[nn.Module, Tokenizer, DictConfig]:
    config = checkpoint_config(checkpoint, path)
    tokenizer = instantiate(config.tokenizer)
    model = build_model(config, tokenizer)
    model.load_state_dict(model_weights(checkpoint, path))
    return model, tokenizer, config


XL_TARGET = "models.llama_xl.build_llama_xl"


def with_window(config: DictConfig, window: int | None, path: str | Path) -> DictConfig:
    """`config` (a checkpoint's training config, or evaluate.py's own) with its plain LM streamed through `window`
    tokens (stride window/2); None leaves it as it is. A Llama-XL's backbone (same weights, same keys) runs as
    that plain LM without its cache: window = segment + cache sees what each XL token sees, minus what the cached
    states carried from further back (the recurrence)."""
    if window is None:
        return config
    if config.model.get("_target_") == XL_TARGET:
        backbone_keys = config.model.get("backbone")  # key_norm / attn_scale of the XL's backbone
        config.model = {"_target_": "models.lm.build_causal_lm", "window": None, "backbone": backbone_keys}
    if "window" not in config.model:
        raise ConfigError(
            f"window={window} sets a plain LM's streaming window, but {path} holds a model without one "
            f"({config.model._target_}); drop window=."
        )
    config.model.window, config.model.stride = int(window), None
    return config


def run_dir_of(ckpt: str | Path) -> Path:
    """RUN_DIR of RUN_DIR/checkpoints/x.ckpt (else the checkpoint's own folder)."""
    folder = Path(ckpt).resolve().parent
    return folder.parent if folder.name == "checkpoints" else folder


def select_device(device: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def autocast_context(
    precision: str | None, device: torch.device, trained: DictConfig | None = None
) -> Callable[[], contextlib.AbstractContextManager]:
    """The evaluation's autocast. `precision` in Lightning's names: 'bf16-mixed' / '16-mixed' autocast, '32-true' full
    precision. Null: full precision where the checkpoint trained in it (its `trainer.precision`:
    the tiny recipe's fp32 model is read in fp32 on a GPU too, as its validation was), else the device's own
    (`auto_precision`: bf16-mixed on CUDA, fp32 on a CPU)."""
    if precision is None:
        trained_in = (
            str(OmegaConf.select(trained, "trainer.precision", default="")) if trained is not None else ""
        )
        precision = "32-true" if trained_in.startswith(("32", "64")) else auto_precision(device.type)
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None, "32": None}
    if str(precision) not in dtypes:
        raise ConfigError(f"precision={precision} is not one of {', '.join(dtypes)} (or null: as trained)")
    dtype = dtypes[str(precision)]
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


# ---- loggers --------------------------------------------------------------------------------------------
def wandb_run_id(run_dir: Path) -> str | None:
    """Id of the training run's W&B run: the `run-<id>.wandb` file of RUN_DIR/wandb/latest-run (or of the newest run
    folder). Folder names are not parsed: a run continued within the same second gets `...-<id>-1`."""
    folder = Path(run_dir) / "wandb"
    latest = folder / "latest-run"
    runs = (
        [latest.resolve()]
        if latest.exists()
        else sorted(folder.glob("*run-*"), key=lambda p: p.stat().st_mtime)
    )
    files = sorted(runs[-1].glob("run-*.wandb")) if runs else []
    return files[0].stem.removeprefix("run-") if files else None


def build_loggers(cfg: DictConfig, run_dir: Path, train_config: DictConfig | None) -> list[Logger]:
    """CSV (RUN_DIR/eval/version_N/metrics.csv) always; W&B with logger=wandb, or by default when the training run
    has a W&B run (then the same run: its id, its project)."""
    chosen = set(cfg.get("logger") or {})
    run_id = wandb_run_id(run_dir)
    loggers: list[Logger] = [CSVLogger(save_dir=str(run_dir), name="eval")]
    if "wandb" in chosen or (not chosen and run_id is not None):
        trained = OmegaConf.select(train_config, "logger.wandb") if train_config is not None else None
        settings = OmegaConf.select(cfg, "logger.wandb") or trained or {}
        loggers.append(
            build_wandb_logger(
                project=settings.get("project", "memlm"),
                save_dir=str(run_dir),
                tags=list(settings.get("tags") or []),
                id=run_id,
            )
        )
    return loggers


def close_loggers(loggers: list[Logger]) -> None:
    for logger in loggers:
        logger.finalize("success")
        if isinstance(logger, WandbLogger):
            import wandb

            wandb.finish()


# ---- the three modes ------------------------------------------------------------------------------------
class CheckpointEvaluator:
    """`(path, checkpoint) -> metrics` for checkpoints of one run: the model is rebuilt only when the config changes,
    results go to `<ckpt>.eval/`, metrics are logged at the checkpoint's global step."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.device = select_device(cfg.device)
        self.loggers: list[Logger] | None = None
        self._built_for: str | None = None

    def __call__(self, path: Path, checkpoint: dict) -> dict[str, float]:
        config = with_window(checkpoint_config(checkpoint, path), self.cfg.get("window"), path)
        key = OmegaConf.to_yaml({k: config.get(k) for k in ("tokenizer", "backbone", "model", "corpus")})
        if key != self._built_for:
            tokenizer = instantiate(config.tokenizer)
            self.model = build_model(config, tokenizer).to(self.device)
            set_threads(self.cfg.get("threads"), self.model, self.device.type == "cuda")
            self.tokenizer = tokenizer
            self.corpus = instantiate(self.cfg.get("corpus") or config.corpus)
            self._built_for = key
        self.model.load_state_dict(model_weights(checkpoint, path))
        self.context = autocast_context(self.cfg.precision, self.device, config)
        if self.loggers is None:
            self.loggers = build_loggers(self.cfg, self.run_dir, config)
        step = int(checkpoint.get("global_step", 0))
        out_dir = results_dir(path, self.cfg.get("window"))
        evaluators = checkpoint_task(OmegaConf.to_container(self.cfg.eval), config)
        metrics, images = evaluate_model(
            self.model, self.tokenizer, self.corpus, evaluators, out_dir, self.context
        )
        write_results(out_dir, str(path), step, metrics)
        log_results(self.loggers, metrics, images, step)
        log.info("%s (step %d): %s", path.name, step, {k: round(v, 4) for k, v in metrics.items()})
        return metrics

    def close(self) -> None:
        close_loggers(self.loggers or [])


def checkpoint_task(evaluators: Mapping, config: Mapping) -> Mapping:
    """The evaluators with `tasks` / `task` (BABILong evaluators, when not given) set to the BABILong task the
    checkpoint trained on (`config`: its training config)."""
    task = (config.get("task") or {}).get("task")  # qa1 ... qa20; LM runs have none
    if task is None:
        return evaluators
    given = {"tasks": [task], "task": task}
    return {
        name: {**node, **{k: v for k, v in given.items() if k in node and node[k] is None}}
        for name, node in evaluators.items()
    }


def export_hf(model: nn.Module, tokenizer: Tokenizer, out_dir: str | Path) -> Path:
    """A Hugging Face Llama folder (model.safetensors, config.json, tokenizer) from a task model whose backbone is
    our Llama; parameters outside the backbone (e.g. RMT memory) are not part of a LlamaForCausalLM."""
    from safetensors.torch import save_file

    backbone = getattr(model, "backbone", model)
    if not hasattr(backbone, "to_hf_state_dict"):
        raise ConfigError(
            f"export=hf needs our Llama backbone (backbone=tiny|llama_83m|smollm2_135m), got "
            f"{type(backbone).__name__}; a Hugging Face backbone is already a Hugging Face model."
        )
    if backbone.cfg.key_norm or backbone.cfg.attn_scale is not None:
        raise ConfigError(
            "This backbone uses L2-normalised keys / a custom attention scale (Llama-XL), which "
            "LlamaForCausalLM cannot express; only plain Llama backbones export to Hugging Face."
        )
    extra = (
        [] if backbone is model else [n for n, _ in model.named_parameters() if not n.startswith("backbone.")]
    )
    if extra:
        log.warning("Not exported (outside the backbone): %s", extra)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in backbone.to_hf_state_dict().items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = backbone.hf_config()
    config.architectures = ["LlamaForCausalLM"]
    config.bos_token_id, config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
    config.save_pretrained(out_dir)
    if hasattr(tokenizer, "tok"):  # a Hugging Face tokenizer
        tokenizer.tok.save_pretrained(out_dir)
    elif hasattr(tokenizer, "sp"):  # SentencePiece: transformers' LlamaTokenizer reads tokenizer.model
        (out_dir / "tokenizer.model").write_bytes(tokenizer.sp.serialized_model_proto())
        (out_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return out_dir


def check_pretrained(cfg: DictConfig) -> None:
    backbone = cfg.get("backbone")
    if backbone is None or (backbone._target_.endswith("build_llama") and not backbone.get("weights")):
        raise ConfigError(
            "Nothing to evaluate: give ckpt_path=/path/to/x.ckpt (or watch=RUN_DIR), or a pretrained backbone: "
            "backbone=smollm2_135m, backbone=hf backbone.name=<hub id or folder>, or backbone.weights=<HF Llama>."
        )


def evaluate(cfg: DictConfig) -> dict:
    """Run the mode the config selects; returns the metrics (watch: {'evaluated': [paths]}, export: its folder)."""
    check_config(cfg, groups=("tokenizer", "backbone", "model", "corpus", "eval"))  # what it may build
    if cfg.watch:
        if cfg.ckpt_path or cfg.export:
            raise ConfigError("watch=RUN_DIR evaluates the run's checkpoints: drop ckpt_path/export.")
        run_dir = Path(cfg.watch)
        if not run_dir.is_dir():
            raise MissingFileError(f"watch={run_dir}: no such run folder (give the training run_dir).")
        evaluator = CheckpointEvaluator(cfg, run_dir)
        try:
            done = watch(
                run_dir / "checkpoints",
                evaluator,
                tag=sorted(cfg.eval),
                window=cfg.get("window"),
                **cfg.watcher,
            )
        finally:
            evaluator.close()
        return {"evaluated": [str(p) for p in done]}
    if cfg.export:
        if cfg.export != "hf":
            raise ConfigError(f"Unknown export={cfg.export!r}; valid: hf")
        if not cfg.ckpt_path:
            raise ConfigError("export=hf needs ckpt_path=/path/to/x.ckpt")
        model, tokenizer, _ = build_from_checkpoint(load_checkpoint(cfg.ckpt_path), cfg.ckpt_path)
        out = export_hf(model, tokenizer, cfg.export_dir or f"{cfg.ckpt_path}.hf")
        log.info("Exported to %s", out)
        return {"export_dir": str(out)}
    if cfg.compare:
        return compare_checkpoints(cfg)
    if cfg.ckpt_path:
        path = Path(cfg.ckpt_path)
        evaluator = CheckpointEvaluator(cfg, run_dir_of(path))
        try:
            return evaluator(path, load_checkpoint(path))
        finally:
            evaluator.close()
    check_pretrained(cfg)
    device = select_device(cfg.device)
    tokenizer = instantiate(cfg.tokenizer)
    model = build_model(with_window(cfg, cfg.get("window"), "the pretrained model"), tokenizer).to(device)
    set_threads(cfg.get("threads"), model, device.type == "cuda")
    corpus = instantiate(cfg.get("corpus") or DEFAULT_CORPUS)
    out_dir = Path(cfg.out_dir)
    loggers = build_loggers(cfg, out_dir, None)
    try:
        metrics, images = evaluate_model(
            model, tokenizer, corpus, cfg.eval, out_dir, autocast_context(cfg.precision, device)
        )
        write_results(out_dir, None, 0, metrics)
        log_results(loggers, metrics, images, step=0)
    finally:
        close_loggers(loggers)
    return metrics


def compare_checkpoints(cfg: DictConfig) -> dict[str, float]:
    """Evaluate each checkpoint of `compare` (results in its `<ckpt>.eval/`), then the comparison into out_dir.
    A model is named by its run folder, and by its checkpoint file where one run gives several (`run@last`,
    `run@stage2-4seg`). An entry that is a folder is read as it is: the out_dir of an earlier evaluate.py run (e.g.
    of a pretrained model), named by it, or the results of a checkpoint (`RUN/checkpoints/last.ckpt.eval`), named
    as that checkpoint."""
    if cfg.ckpt_path or cfg.watch or cfg.export:
        raise ConfigError(
            "compare=[A.ckpt,B.ckpt,...] evaluates its own checkpoints: drop ckpt_path/watch/export."
        )
    paths = [Path(p) for p in cfg.compare]
    window = cfg.get("window")
    # the checkpoint of each entry and its window: a file (window=), or the results folder of one; None: an out_dir
    ckpts, windows = zip(
        *(evaluated_checkpoint(p) if p.is_dir() else (p, window) for p in paths), strict=True
    )
    runs = [run_dir_of(c) if c else None for c in ckpts]
    labels = []  # the run's name (@checkpoint where it gives several; +window<W> where streamed through one)
    for path, ckpt, run, w in zip(paths, ckpts, runs, windows, strict=True):
        name = path.name if run is None else f"{run.name}@{ckpt.stem}" if runs.count(run) > 1 else run.name
        labels.append(f"{name}+window{w}" if w else name)
    evaluators: dict[Path, CheckpointEvaluator] = {}  # one a run: its checkpoints share the model and loggers
    models = []
    try:
        for path, run, label in zip(paths, runs, labels, strict=True):
            if path.is_dir():  # results of an earlier run: an out_dir, or a checkpoint's <ckpt>.eval
                models.append(EvaluatedModel.load(path, label))
                continue
            checkpoint = load_checkpoint(path)
            if run not in evaluators:
                evaluators[run] = CheckpointEvaluator(cfg, run)
            evaluators[run](path, checkpoint)
            step = int(checkpoint.get("global_step", 0))
            models.append(EvaluatedModel.load(results_dir(path, window), label, step))
    finally:
        for evaluator in evaluators.values():
            evaluator.close()
    return compare(models, cfg.out_dir, cfg.compare_score_length)


def results_folder(cfg: DictConfig) -> Path:
    """Where a mode writes: the training run's folder (checkpoint, watch, export beside the checkpoint), else
    out_dir (a pretrained model)."""
    if cfg.watch:
        return Path(cfg.watch)
    if cfg.export and cfg.export_dir:
        return Path(cfg.export_dir)
    return run_dir_of(cfg.ckpt_path) if cfg.ckpt_path and not cfg.compare else Path(cfg.out_dir)


@hydra.main(version_base="1.3", config_path=str(cli.CONFIGS), config_name="eval")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with cli.user_errors(cfg):
        result = evaluate(cfg)
    log.info("%s", json.dumps(result, indent=2))
    cli.report_outputs(results_folder(cfg))


if __name__ == "__main__":
    cli.run(main, "eval")
