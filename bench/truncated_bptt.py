"""A long curriculum stage with truncated BPTT: a BABILong batch of many segments whose answer (last segment)
back-propagates through the last k2 + 1 only. The segments no loss reaches run without an autograd graph
(`RMT.needs_graph`); against running every segment with one (as before), one thread, the same model and batch:

    python -m bench.truncated_bptt [--model armt] [--segments 128] [--k2 31] [--rows 4] [--steps 5]

Prints seconds per training step (forward + backward) and the activations autograd keeps, each way, and their ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch
from hydra import compose, initialize_config_dir

from models.builders import build_model, instantiate, register_resolvers
from models.cli import CONFIGS
from models.rmt import RMT


def build(model: str, k2: int) -> torch.nn.Module:
    """The CPU recipe's model (`model=<model> task=qa1`: backbone=tiny_babi) with truncated BPTT depth k2."""
    register_resolvers()
    overrides = [f"model={model}", "task=qa1", "backbone_init=null", f"model.k2={k2}"]
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return build_model(cfg, instantiate(cfg.tokenizer)).train()


def step(model: torch.nn.Module, batch: dict) -> tuple[float, int]:
    """Seconds of forward + backward, and bytes of the tensors autograd saved for backward."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch)
    torch.nn.functional.cross_entropy(out.logits, out.targets).backward()
    return time.perf_counter() - t0, saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="armt", help="rmt | rmt_r | armt")
    p.add_argument("--segments", type=int, default=128)
    p.add_argument("--k2", type=int, default=31)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build(args.model, args.k2)
    ids = torch.randint(0, 32000, (args.rows, args.segments * model.segment_size))
    labels = torch.full_like(ids, -100)
    labels[:, -2:] = ids[:, -2:]  # the answer and its end, in the last segment
    batch = {"input_ids": ids, "labels": labels}
    every_segment = mock.patch.object(
        RMT, "needs_graph", lambda self, scored, bounds, rec: [True] * len(bounds)
    )
    results = {}
    for name, patch in (
        ("every segment with a graph (before)", every_segment),
        ("only where a loss reaches", contextlib.nullcontext()),
    ):
        with patch:
            step(model, batch)  # warm-up
            runs = [step(model, batch) for _ in range(args.steps)]
        results[name] = (min(t for t, _ in runs), runs[0][1])
    print(
        f"{args.model}, {args.rows} rows x {args.segments} segments of {model.segment_size} tokens, k2={args.k2}, "
        "one thread:"
    )
    for name, (t, saved) in results.items():
        print(f"  {name:38s} {t:6.2f} s/step  {saved / 2**20:8.1f} MiB saved for backward")
    (t0, s0), (t1, s1) = results.values()
    print(f"  ratio: {t0 / t1:.2f}x faster, {s0 / s1:.1f}x less activation memory")


if __name__ == "__main__":
    main()
