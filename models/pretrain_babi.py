"""Warm start for tiny backbones on BABILong: train the backbone on bAbI stories alone (no background), save it,
and start `train.py` from it (`backbone_init=<file>`), as the paper starts from a pretrained GPT-2.

Why: a randomly initialised tiny RMT trained on the answers alone sits for thousands of steps at the "most recent
location" plateau of qa1 (~50%): binding a location to the person of its sentence needs a two-layer circuit whose
first layer gets no gradient until the second attends by name. A dense signal breaks the plateau: next-token
prediction over every story token (local attention forms first) plus the answer. Both losses are means over their
tokens, computed over the task's own vocabulary (the tokens its texts use), so a 32k-token head costs nothing.
Every batch draws fresh samples from a large generated pool, so the model learns the rule, not the stories.

    python -m models.pretrain_babi --task qa1 --out checkpoints/tiny_qa1.pt [hydra overrides, e.g. backbone=tiny]

The backbone is built from the same Hydra config as `train.py` (tokenizer, backbone), so the weights fit it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from data.babi import generate_task
from data.babilong import EncodedSample, TaskTokens, assemble, check_task, collate
from models.builders import build_backbone, instantiate, register_resolvers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def facts_only(tasks: TaskTokens, i: int) -> EncodedSample:
    """Sample i with no background: [bos] facts question prompt answer [eos]."""
    context = np.concatenate([np.zeros(0, np.int64), *tasks.facts[i]])
    return assemble(tasks.bos, context, tasks.tail[i], tasks.answer[i], tasks.eos)


class TaskVocabulary:
    """The token ids a pool uses; logits restricted to them: (N, D) hidden -> (N, v) over those tokens."""

    def __init__(self, tasks: TaskTokens, vocab_size: int):
        pieces = [f for fs in tasks.facts for f in fs] + tasks.tail + tasks.answer
        used = np.unique(np.concatenate([np.asarray([tasks.eos], np.int64), *pieces]))
        self.ids = torch.from_numpy(used)
        self.index = torch.full((vocab_size,), -100, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(used))

    def logits(self, backbone: nn.Module, hidden: Tensor) -> Tensor:
        return F.linear(hidden, head_weight(backbone)[self.ids])


def head_weight(backbone: nn.Module) -> Tensor:
    """(V, D) output matrix of our Llama or a Hugging Face backbone."""
    head = getattr(backbone, "lm_head", None)
    if head is None and hasattr(backbone, "model"):
        head = backbone.model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{type(backbone).__name__} has no linear output head to restrict to the task vocabulary."
        )
    return head.weight


def losses(backbone: nn.Module, vocab: TaskVocabulary, batch: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Answer CE, context CE (means over their tokens) and the answer's exact match per row (B,)."""
    hidden = backbone(batch["input_ids"], attention_mask=batch["attention_mask"])  # (B, T, D)
    scored = batch["labels"] != -100
    logits = vocab.logits(backbone, hidden[scored])  # (N, v)
    targets = vocab.index[batch["labels"][scored]]
    answer = batch["answer_mask"][scored]
    ce = F.cross_entropy(logits, targets, reduction="none")
    ctx = ce[~answer].mean() if bool((~answer).any()) else ce.new_zeros(())
    wrong = (logits.argmax(-1) != targets) & answer
    rows = scored.nonzero()[:, 0]
    n_wrong = torch.zeros(len(scored), dtype=torch.long).index_add_(0, rows, wrong.long())
    return ce[answer].mean(), ctx, n_wrong == 0


def pretrain(
    backbone: nn.Module,
    tokenizer,
    task: str = "qa1",
    steps: int = 4000,
    batch_size: int = 32,
    lr: float = 2e-3,
    warmup_steps: int = 100,
    context_weight: float = 1.0,
    n_pool: int = 200_000,
    n_val: int = 512,
    eval_every: int = 250,
    target_accuracy: float | None = None,
    seed: int = 0,
    log=print,
) -> float:
    """Train `backbone` in place on facts-only samples of `task`; returns the final validation exact match.

    Stops early once the validation accuracy reaches `target_accuracy` (None: run every step).
    """
    check_task(task)
    pool = TaskTokens(generate_task(task, n=n_pool, seed=seed), tokenizer)
    val = TaskTokens(generate_task(task, n=n_val, seed=seed + 10**6), tokenizer)
    vocab = TaskVocabulary(pool, backbone.vocab_size)
    val_batches = [
        collate([facts_only(val, i) for i in range(a, min(a + 128, n_val))], tokenizer.pad_id)
        for a in range(0, n_val, 128)
    ]

    @torch.no_grad()
    def accuracy() -> float:
        backbone.eval()
        hits = torch.cat([losses(backbone, vocab, b)[2] for b in val_batches])
        backbone.train()
        return float(hits.float().mean())

    opt = torch.optim.AdamW(backbone.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup_steps))
    rng = np.random.default_rng(seed)
    t0, acc = time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        rows = [facts_only(pool, int(i)) for i in rng.integers(len(pool), size=batch_size)]
        answer, ctx, _ = losses(backbone, vocab, collate(rows, tokenizer.pad_id, context_loss=True))
        loss = answer + context_weight * ctx
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(backbone.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            acc = accuracy()
            minutes = (time.perf_counter() - t0) / 60
            log(
                json.dumps(
                    {
                        "step": step,
                        "answer_loss": round(answer.item(), 4),
                        "acc": acc,
                        "min": round(minutes, 2),
                    }
                )
            )
            if target_accuracy is not None and acc >= target_accuracy:
                break
    return acc


def save_backbone(backbone: nn.Module, path: str | Path, backbone_cfg: DictConfig, **meta) -> None:
    """The backbone's weights with the config that builds it (checked when loaded)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.to_container(backbone_cfg, resolve=True)
    torch.save({"state_dict": backbone.state_dict(), "backbone": cfg, **meta}, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="qa1")
    p.add_argument("--out", required=True, help="where to save the backbone (.pt)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--target-accuracy", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides of configs/train.yaml (tokenizer=, backbone=...)"
    )
    a = p.parse_args()
    register_resolvers()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=a.overrides)
    torch.manual_seed(a.seed)
    torch.set_num_threads(cfg.get("threads") or 1)
    tokenizer = instantiate(cfg.tokenizer)
    backbone = build_backbone(cfg.backbone, tokenizer)
    acc = pretrain(
        backbone,
        tokenizer,
        a.task,
        a.steps,
        a.batch_size,
        a.lr,
        target_accuracy=a.target_accuracy,
        seed=a.seed,
    )
    save_backbone(backbone, a.out, cfg.backbone, task=a.task, facts_only_accuracy=acc)
    print(f"Saved the backbone to {a.out} (facts-only {a.task} exact match {acc:.3f})")


if __name__ == "__main__":
    main()
