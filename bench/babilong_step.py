"""The main job's step (`python train.py model=rmt_r task=qa1`, issue #14): the Lightning run exactly as train.py
builds it (curriculum batches made by data workers, every callback, logging) against a hand-written torch loop over
the same model and the same batches made beforehand (forward, the injected loss, backward, clipping, AdamW), one
run, one thread (`--threads`: more, for a run alone on the machine). Also the cost of one validation (the recipe
validates every `trainer.val_check_interval` steps).
Both run in the recipe's fp32 (`trainer.precision: 32-true`, on a GPU too) or, with `--precision bf16-mixed`, both in
bf16 autocast (on a CPU with AMX: the measured answer to "bf16 where the CPU has AMX", README "Tests and benchmarks").

    python -m bench.babilong_step [--model rmt_r] [--segments 2] [--steps 60] [--workers 2] [--threads 1]
        [--device cuda] [--precision bf16-mixed] [--compile]

`--compile` runs both with the backbone under `torch.compile` (train.py's `compile=true`; the first steps compile and
are left out of the timing with the warmup).

Prints seconds per step of each, their ratio (target: Lightning / torch <= 1.2) and validation's share per step.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir

from bench.throughput import Timer, sync
from data.babilong import batch_to
from models.builders import build_model, build_run, instantiate, register_resolvers
from models.cli import CONFIGS


def compose_main_job(args, run_dir: str):
    """The main job's config, without the warm start (weights do not change the time) and one fixed length."""
    register_resolvers()
    overrides = [
        f"model={args.model}",
        "task=qa1",
        "backbone_init=null",
        "curriculum=fixed",
        f"curriculum.schedule=[{args.segments}]",
        f"trainer.max_steps={args.steps + args.warmup}",
        "trainer.limit_val_batches=0",
        f"task.num_workers={args.workers}",
        f"threads={args.threads}",
        f"trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
        f"run_dir={run_dir}",
        f"compile={str(args.compile).lower()}",
        f"trainer.precision={args.precision}",
    ]
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=overrides)


def lightning_step(cfg, args) -> tuple[float, float, dict]:
    """Seconds per training step of the Lightning run, seconds of one validation pass, and the recipe's numbers."""
    run = build_run(cfg)
    timer = Timer(args.warmup)
    run.trainer.callbacks.append(timer)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    step = (timer.t1 - timer.t0) / args.steps
    run.trainer.limit_val_batches = 1.0
    t0 = time.perf_counter()
    run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
    return step, time.perf_counter() - t0, {"val_every": cfg.trainer.val_check_interval}


def torch_step(cfg, args) -> float:
    """Seconds per step of the same work by hand: the same batches (made first), model, loss, clipping, AdamW."""
    tokenizer = instantiate(cfg.tokenizer)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tokenizer).train()
    if args.compile:
        model.backbone.compile()  # as build_run does with compile=true
    loss_fn = instantiate(cfg.loss)
    data = instantiate(cfg.task, _partial_=True)(tokenizer=tokenizer, corpus=instantiate(cfg.corpus))
    data.num_workers = 0
    loader = iter(data.train_dataloader())
    device = torch.device(args.device)
    model.to(device)
    batches = [batch_to(next(loader), device) for _ in range(args.steps + args.warmup)]
    o = cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    for i, batch in enumerate(batches):
        if i == args.warmup:
            sync(device.type)
            t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = loss_fn(model(batch), model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val or float("inf"))
        opt.step()
        loss.item()
    sync(device.type)
    return (time.perf_counter() - t0) / args.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rmt_r", help="rmt | rmt_r | armt")
    p.add_argument(
        "--segments", type=int, default=2, help="segments of 128 tokens per sample (the recipe: 2)"
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", type=int, default=2, help="data workers (task.num_workers; the recipe: 2)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (train.py's threads=; tiny models: 1)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"], help="both runs")
    p.add_argument("--compile", action="store_true", help="torch.compile the backbone (compile=true)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_main_job(args, run_dir)
        lit, val, recipe = lightning_step(cfg, args)
    hand = torch_step(cfg, args)
    every = recipe["val_every"]
    print(
        f"{args.model}, batch {cfg.task.batch_size} x {args.segments} segments of {cfg.model.segment_size} tokens, "
        f"{args.threads} thread(s), {args.workers} data workers, {args.device}, {args.precision}"
        f"{', compiled' * args.compile}:\n"
        f"  Lightning run (train.py's)  {lit * 1000:7.1f} ms/step\n"
        f"  hand-written torch loop     {hand * 1000:7.1f} ms/step   ratio {lit / hand:.3f} (target <= 1.2)\n"
        f"  one validation              {val:7.2f} s = {val / every * 1000:.1f} ms/step at one every {every} steps"
    )


if __name__ == "__main__":
    main()
