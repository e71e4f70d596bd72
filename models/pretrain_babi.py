"""Warm start for tiny backbones on BABILong: train the backbone on bAbI stories alone (no background), save it,
and start `train.py` from it (`backbone_init=<file>`), as the paper starts from a pretrained GPT-2.

Why: a randomly initialised tiny RMT trained on the answers alone sits for thousands of steps at the "most recent
location" plateau of qa1 (~50%): binding a location to the person of its sentence needs a two-layer circuit whose
first layer gets no gradient until the second attends by name. A dense signal breaks the plateau: next-token
prediction over every story token (local attention forms first) plus the answer. Both losses are means over their
tokens, over the task's own vocabulary: a copy of the backbone with only the embedding and head rows of the
tokens the task's texts use is trained (a 32k-token vocabulary costs nothing) and written back.
Every batch draws fresh samples from a large generated pool, so the model learns the rule, not the stories.

`backbone_init=warm_start` (the default of task=qa* with backbone=tiny_babi) builds the file on first use,
cached under $MEMLM_CACHE/warm_start by the backbone, tokenizer, task and `warm_start` settings; every later run with
the same ones loads it. The same file, ahead of time (or to --out FILE):

    python -m models.pretrain_babi model=rmt_r task=qa1

The backbone is built from the same Hydra config as `train.py` with the same overrides, so the weights fit it.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from rich.progress import Progress
from torch import Tensor, nn

from data.babi import REVISIONS, generate_task, task_name
from data.babilong import EncodedSample, TaskTokens, assemble, check_task, collate
from data.corpus import default_cache_dir
from models import cli
from models.builders import build_backbone, instantiate, load_backbone_init, register_resolvers
from models.config_checks import check_config
from models.config_errors import ConfigError
from models.lit_module import exact_match
from models.llama import Llama

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
log = logging.getLogger(__name__)


def facts_only(tasks: TaskTokens, i: int) -> EncodedSample:
    """Sample i with no background: [bos] facts question prompt answer [eos]."""
    context = np.concatenate([np.zeros(0, np.int64), *tasks.facts[i]])
    return assemble(tasks.bos, context, tasks.tail[i], tasks.answer[i], tasks.eos)


class TaskVocabulary:
    """The token ids a pool uses (with bos, eos, pad), and the map from them to 0..v-1."""

    def __init__(self, tasks: TaskTokens, pad_id: int):
        pieces = [f for fs in tasks.facts for f in fs] + tasks.tail + tasks.answer
        special = np.asarray([tasks.bos, tasks.eos, pad_id], np.int64)
        self.ids = torch.from_numpy(np.unique(np.concatenate([special, *pieces])))  # (v,)
        self.index = torch.full((int(self.ids.max()) + 1,), -100, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(self.ids))

    def compact(self, batch: dict) -> dict:
        """The batch in compact ids (labels keep -100)."""
        labels = batch["labels"]
        compact_labels = torch.where(labels == -100, labels, self.index[labels.clamp(min=0)])
        return batch | {"input_ids": self.index[batch["input_ids"]], "labels": compact_labels}


def compact_backbone(backbone: Llama, vocab: TaskVocabulary) -> Llama:
    """A copy of `backbone` with only the vocabulary's rows of its embedding and head (v instead of V tokens).
    With no weight decay, Adam leaves the other rows untouched, so training the copy trains the backbone."""
    if not isinstance(backbone, Llama):
        raise ConfigError(
            f"Warm start needs our Llama backbone (backbone=tiny ...), got {type(backbone).__name__}."
        )
    small = Llama(dataclasses.replace(backbone.cfg, vocab_size=len(vocab.ids)))
    state = backbone.state_dict()
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][vocab.ids]
    small.load_state_dict(state)
    return small


def write_back(small: Llama, backbone: Llama, vocab: TaskVocabulary) -> None:
    """Copy the trained compact weights into the full backbone (its other vocabulary rows are unchanged)."""
    state = backbone.state_dict()
    for name, value in small.state_dict().items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            state[name] = state[name].clone().index_copy_(0, vocab.ids, value)
        else:
            state[name] = value
    backbone.load_state_dict(state)


def losses(model: nn.Module, batch: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Answer CE, context CE (means over their tokens) and the answer's exact match per row (B,)."""
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"])  # (B, T, D)
    scored = batch["labels"] != -100
    logits = model.head(hidden[scored])  # (N, v)
    targets = batch["labels"][scored]
    answer = batch["answer_mask"][scored]
    ce = F.cross_entropy(logits, targets, reduction="none")
    ctx = ce[~answer].mean() if bool((~answer).any()) else ce.new_zeros(())
    return ce[answer].mean(), ctx, exact_match(logits, targets, batch).bool()


def asking(samples: list, question: str, task: str) -> list:
    """The samples whose question starts with `question`."""
    chosen = [s for s in samples if s.question.startswith(question)]
    if not chosen:
        asked = sorted({" ".join(s.question.split()[:2]) for s in samples})
        raise ConfigError(
            f"warm_start.focus: no {task} question starts with {question!r}; its questions start with {asked}."
        )
    return chosen


def draw_source(
    pool: TaskTokens, focused: TaskTokens, focus: dict, step: int, rng: np.random.Generator
) -> TaskTokens:
    """The stories step `step` (from 1) draws its batch from: the focused ones for the first focus["steps"]
    steps, then with probability focus["share"]."""
    return focused if step <= focus["steps"] or rng.random() < focus["share"] else pool


def pretrain(
    backbone: nn.Module,
    tokenizer,
    task: str = "qa1",
    steps: int = 9000,
    batch_size: int = 32,
    batch_tokens: int | None = None,
    lr: float = 2e-3,
    warmup_steps: int = 100,
    context_weight: float = 1.0,
    n_pool: int = 200_000,
    n_val: int = 512,
    eval_every: int = 250,
    target_accuracy: float | None = None,
    seed: int = 0,
    focus: dict | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> float:
    """Train `backbone` in place on facts-only samples of `task`; returns the final validation exact match.
    A batch has `batch_size` stories of one length band, fewer for long bands with a token budget `batch_tokens`
    (TaskTokens.draw_facts_only): qa2, qa3 and qa5 stories run to hundreds of tokens.

    `focus` ({question, steps, share}): the stories whose question starts with `question` fill every batch of the
    first `steps` steps and, after them, a `share` of the batches; each evaluation also reports their accuracy.
    Stops early once the validation accuracy reaches `target_accuracy` (None: run every step). `log` (default:
    print) gets what the run will do, a JSON line per evaluation (with the ETA of the remaining steps) and why it
    stopped; progress: a bar with rate and ETA that ends full when the target stops the run early.
    """
    log = log or partial(print, flush=True)
    check_task(task)
    samples = generate_task(task, n=n_pool, seed=seed)
    val_samples = generate_task(task, n=n_val, seed=seed + 10**6)
    pool, val = TaskTokens(samples, tokenizer), TaskTokens(val_samples, tokenizer)
    focused = None if focus is None else TaskTokens(asking(samples, focus["question"], task), tokenizer)
    vocab = TaskVocabulary(pool, tokenizer.pad_id)
    missing = set(np.concatenate([*val.answer, *val.tail]).tolist()) - set(vocab.ids.tolist())
    if missing:
        raise ConfigError(f"Validation tokens {sorted(missing)} never occur in the pool: raise n_pool.")
    model = compact_backbone(backbone, vocab)
    # validation needs no gradients: 4x a training batch's tokens
    val_budget = None if batch_tokens is None else 4 * batch_tokens
    val_rows = val.facts_only_batches(128, val_budget)
    val_batches = [
        vocab.compact(collate([facts_only(val, int(i)) for i in rows], tokenizer.pad_id)) for rows in val_rows
    ]
    val_focus = torch.tensor(  # (n_val,) in val_rows' order: the held-out stories asking the focus question
        [
            focus is not None and val_samples[i].question.startswith(focus["question"])
            for i in np.concatenate(val_rows)
        ]
    )

    @torch.no_grad()
    def accuracy() -> dict[str, float]:
        model.eval()
        hits = torch.cat([losses(model, b)[2] for b in val_batches]).float()
        model.train()
        return {"acc": float(hits.mean())} | (
            {"focus_acc": round(float(hits[val_focus].mean()), 4)} if val_focus.any() else {}
        )

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup_steps))
    rng = np.random.default_rng(seed)
    budget = f" (at most {batch_tokens} tokens)" if batch_tokens else ""
    stop = f", stopping once it reaches {target_accuracy}" if target_accuracy is not None else ""
    first = ""
    if focus is not None:
        first = (
            f" The first {focus['steps']} steps, then a share {focus['share']} of the batches, draw from its "
            f'{len(focused)} stories asking "{focus["question"]}..." (focus_acc: their held-out exact match).'
        )
    log(
        f"Warm start: next-token training of the backbone on {task} facts-only stories, up to {steps} steps of "
        f"{batch_size} stories{budget}; facts-only exact match on {n_val} held-out stories every {eval_every} steps{stop}.{first}"
    )
    t0, acc = time.perf_counter(), 0.0
    with Progress(*Progress.get_default_columns(), disable=not progress) as bar:
        job = bar.add_task(f"pretraining on {task}", total=steps)
        for step in range(1, steps + 1):
            source = pool if focus is None else draw_source(pool, focused, focus, step, rng)
            rows = [facts_only(source, int(i)) for i in source.draw_facts_only(rng, batch_size, batch_tokens)]
            batch = vocab.compact(collate(rows, tokenizer.pad_id, context_loss=True))
            answer, ctx, _ = losses(model, batch)
            loss = answer + context_weight * ctx
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.advance(job)
            if step % eval_every == 0 or step == steps:
                scores = accuracy()
                acc, minutes = scores["acc"], (time.perf_counter() - t0) / 60
                line = {
                    "step": step,
                    "answer_loss": round(answer.item(), 4),
                    **scores,
                    "min": round(minutes, 2),
                }
                line["eta_min"] = round(
                    minutes / step * (steps - step), 1
                )  # to the last step; less if it stops early
                log(json.dumps(line))
                if target_accuracy is not None and acc >= target_accuracy:
                    bar.update(job, total=step)  # done: the bar ends full, not at the share of steps run
                    log(
                        f"Reached facts-only exact match {acc:.3f} >= {target_accuracy} at step {step}: stopping."
                    )
                    break
    write_back(model, backbone, vocab)
    return acc


def save_backbone(backbone: nn.Module, path: str | Path, backbone_cfg: DictConfig, **meta) -> None:
    """The backbone's weights with the config that builds it (checked when loaded)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.to_container(backbone_cfg, resolve=True)
    tmp = path.with_name(path.name + ".tmp")  # written whole, then renamed: never a truncated file
    torch.save({"state_dict": backbone.state_dict(), "backbone": cfg, **meta}, tmp)
    tmp.replace(path)


# The task whose warm start a task's own starts from (warm_start.from_task=auto): qa2 asks where the person holding
# an object is, so it builds on qa1's who-is-where (facts-only 0.50 from random weights, 0.66 from qa1's), and qa3
# asks where the object was before, building on qa2's (0.18 against 0.47 at step 4,500; docs/babilong_qa2_qa5.md).
FIRST_LEARN = {"qa2": "qa1", "qa3": "qa2"}


def from_task(cfg: DictConfig) -> str | None:
    """The task whose warm-started backbone this run's warm start begins from (None: random weights)."""
    task, first = cfg.task.get("task"), cfg.warm_start.get("from_task")
    first = FIRST_LEARN.get(task) if first == "auto" else first
    if first is not None:
        check_task(first)
        if first == task:
            raise ConfigError(
                f"warm_start.from_task={first} is the task itself: give another task, auto or null."
            )
    return first


def settings_of(cfg: DictConfig) -> dict:
    """The `warm_start` settings pretrain() takes for this run's task: `steps` null means the task's own cap
    (`task_steps`: qa1 reaches its target within 6,750-9,250 steps by machine, the others plateau below it)."""
    settings = OmegaConf.to_container(cfg.warm_start, resolve=True)
    settings.pop("from_task", None)
    settings.pop("from_backbone", None)
    caps = settings.pop("task_steps", None) or {}
    if (focus := (settings.pop("focus", None) or {}).get(cfg.task.get("task"))) is not None:
        if set(focus) != {"question", "steps", "share"} or not 0 <= focus["share"] <= 1 or focus["steps"] < 0:
            raise ConfigError(
                f"warm_start.focus.{cfg.task.task} needs question (its start), steps >= 0 and 0 <= share <= 1, "
                f"got {focus}"
            )
        settings["focus"] = focus  # only then: the other tasks' cached warm starts keep their keys
    if settings["steps"] is None:
        settings["steps"] = caps.get(cfg.task.get("task"), caps.get("default"))
    if settings["steps"] is None:
        raise ConfigError(
            "warm_start.steps=null needs warm_start.task_steps.default (or give warm_start.steps=N)"
        )
    if not isinstance(settings["steps"], int) or settings["steps"] < 1:
        raise ConfigError(
            f"warm_start.steps must be a number of steps >= 1 (or null), got {settings['steps']!r}"
        )
    return settings


def first_task_config(cfg: DictConfig, first: str) -> DictConfig:
    """The config of the warm start this run's warm start begins from: task `first`, with its own `from_task=auto`."""
    return OmegaConf.merge(cfg, {"task": {"task": first}, "warm_start": {"from_task": "auto"}})


def first_backbone_config(cfg: DictConfig) -> DictConfig | None:
    """The config of the warm start a task that begins from no other task's begins from: the same task on the
    backbone with `warm_start.from_backbone`'s settings (e.g. no stick-breaking heads); None when unset."""
    changes = cfg.warm_start.get("from_backbone")
    if not changes or from_task(cfg) is not None:
        return None
    unknown = sorted(set(changes) - set(cfg.backbone))
    if unknown:
        raise ConfigError(f"warm_start.from_backbone names {unknown}, which backbone= has no setting of")
    return OmegaConf.merge(cfg, {"backbone": changes, "warm_start": {"from_backbone": None}})


def backbone_identity(backbone_cfg: DictConfig) -> dict:
    """The backbone settings a cache key holds; stick_breaking_heads=0 as if absent (keys from before it stay)."""
    identity = OmegaConf.to_container(backbone_cfg, resolve=True)
    if identity.get("stick_breaking_heads") == 0:
        del identity["stick_breaking_heads"]
    return identity


def load_other_backbone(backbone: nn.Module, path: Path) -> list[str]:
    """Load the warm start of the backbone without `backbone`'s extra parameters (the stick-breaking biases):
    every tensor of the file, the others left at their initial values, whose names it returns."""
    saved = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    missing, unexpected = backbone.load_state_dict(saved, strict=False)
    if unexpected:
        raise ConfigError(f"{path} holds tensors this backbone has no place for: {unexpected}")
    return missing


def warm_start_file(cfg: DictConfig) -> Path:
    """Where the warm start of this run's backbone, tokenizer, task and `warm_start` settings is cached."""
    task = cfg.task.get("task")
    if task is None:
        raise ConfigError(
            "backbone_init=warm_start pretrains the backbone on a BABILong task's stories: use it with "
            "task=qa1 ... qa20, or set backbone_init=null (random weights) or a file."
        )
    identity = {
        "backbone": backbone_identity(cfg.backbone),
        "tokenizer": OmegaConf.to_container(cfg.tokenizer, resolve=True),
    }
    identity["warm_start"] = settings_of(cfg)
    if (revision := REVISIONS.get(task_name(task))) is not None:  # the task's stories changed: a new file
        identity["revision"] = revision
    if (first := from_task(cfg)) is not None:  # keyed by the file it starts from: a new start, a new file
        identity["from_task"] = warm_start_file(first_task_config(cfg, first)).name
    if (other := first_backbone_config(cfg)) is not None:  # the other backbone's warm start of this task
        identity["from_backbone"] = warm_start_file(other).name
    key = hashlib.sha256(json.dumps({**identity, "task": task}, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "warm_start" / f"{task}-{key}.pt"


def warm_start(cfg: DictConfig, tokenizer) -> Path:
    """The warm-started backbone file of this run (`warm_start_file`): trained on first use, then reused.
    Concurrent runs (DDP ranks, parallel jobs) wait for the one that trains it. The global RNG is left as it was."""
    path = warm_start_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Waiting for another process to finish the warm start %s (it logs its progress)", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        settings = settings_of(cfg)
        task, first = cfg.task.task, from_task(cfg)
        other = first_backbone_config(cfg)  # None when it starts from another task
        start = None  # the first task's warm start, built (or found) first, from its own `auto`
        if first is not None:
            start = warm_start(first_task_config(cfg, first), tokenizer)
        elif other is not None:  # or this task's on the other backbone
            start = warm_start(other, tokenizer)
        log.info("Warm-starting the backbone on %s stories (once; cached as %s): %s", task, path, settings)
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.get("threads") or 1)  # a tiny backbone: one thread is fastest
        with torch.random.fork_rng():
            torch.manual_seed(settings["seed"])
            backbone = build_backbone(cfg.backbone, tokenizer)
            if other is not None:
                kept = load_other_backbone(backbone, start)
                log.info(
                    "Starting from %s (%s), %s at their initial values",
                    start,
                    dict(cfg.warm_start.from_backbone),
                    kept,
                )
            elif start is not None:
                log.info("Starting from the %s warm start %s", first, start)
                load_backbone_init(backbone, str(start), cfg.backbone)
            t0 = time.perf_counter()
            acc = pretrain(backbone, tokenizer, task, **settings, log=log.info, progress=True)
        torch.set_num_threads(threads)
        save_backbone(backbone, path, cfg.backbone, task=task, facts_only_accuracy=acc)
        log.info(
            "Warm start done in %.1f min: facts-only %s exact match %.3f",
            (time.perf_counter() - t0) / 60,
            task,
            acc,
        )
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write here instead of the cache")
    p.add_argument("overrides", nargs="*", help="the train.py overrides of the run to warm-start")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    register_resolvers()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=a.overrides)
    check_config(cfg)
    torch.set_num_threads(cfg.get("threads") or 1)
    tokenizer = instantiate(cfg.tokenizer)
    path = warm_start(cfg, tokenizer)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_bytes(path.read_bytes())
        path = a.out
    print(f"Warm-started backbone: {path} (train.py backbone_init={path}, or backbone_init=warm_start)")


if __name__ == "__main__":
    cli.run(main, "train")
