"""Warm-start step cost with and without a token budget (`warm_start.batch_tokens`), on one task's facts-only
stories: ms a step and tokens a step of the task's backbone and warm-start settings as `train.py task=<task>` composes
them (backbone=tiny_babi), both budgets alternated in one run, and the ratio. Long-story tasks (qa2, qa3, qa5) are where the budget matters; qa1's and
qa4's stories fit one 128-token band, so their batches are the same either way.

Run from the repo root: /work/venv/bin/python -m bench.warm_start [--task qa5 --steps 100 --budget 4096]
(--budget and --batch-size default to the config's warm_start.batch_tokens and warm_start.batch_size).
"""

import argparse
import time

import numpy as np
import torch
from hydra import compose, initialize_config_dir

from data.babi import generate_task
from data.babilong import TaskTokens, collate
from models.builders import build_backbone, instantiate, register_resolvers
from models.cli import CONFIGS
from models.pretrain_babi import TaskVocabulary, compact_backbone, facts_only, losses


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="qa5")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--pool", type=int, default=20000)
    a = parser.parse_args()
    torch.set_num_threads(1)
    register_resolvers()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["model=rmt_r", f"task={a.task}"])
    a.batch_size = a.batch_size or cfg.warm_start.batch_size
    a.budget = a.budget or cfg.warm_start.batch_tokens
    tok = instantiate(cfg.tokenizer)
    pool = TaskTokens(generate_task(a.task, n=a.pool, seed=0), tok)
    vocab = TaskVocabulary(pool, tok.pad_id)
    model = compact_backbone(build_backbone(cfg.backbone, tok), vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start.lr)
    best: dict[int | None, tuple[float, float]] = {}
    for budget in (None, a.budget) * 2:  # alternated, best of two: both see the same machine state
        rng, tokens, t = np.random.default_rng(0), 0, time.perf_counter()
        for _ in range(a.steps):
            rows = [facts_only(pool, int(i)) for i in pool.draw_facts_only(rng, a.batch_size, budget)]
            batch = vocab.compact(collate(rows, tok.pad_id, context_loss=True))
            tokens += batch["input_ids"].numel()
            answer, context, _ = losses(model, batch)
            (answer + context).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ms = (time.perf_counter() - t) / a.steps * 1000
        best[budget] = min(best.get(budget, (float("inf"), 0.0)), (ms, tokens / a.steps))
    for budget, (ms, tokens) in best.items():
        print(f"{a.task} batch_tokens={budget}: {ms:.0f} ms/step, {tokens:.0f} tokens/step (padded)")
    print(f"ratio (no budget / budget): {best[None][0] / best[a.budget][0]:.2f}x")


if __name__ == "__main__":
    main()
