"""The CPU training step of the tiny LM before and after `data.heap.keep_freed_memory` (glibc `mallopt`).

By default glibc hands every freed block over 32 MB back to the kernel, and the next step page-faults it back in;
the tiny LM's step (experiment=tiny_lm shapes: 16 x 256 tokens, vocabulary 32000, so 524 MB of logits and as much
again for their gradient) then spends most of its time in the kernel. The same steps run first with the default,
then after keep_freed_memory() (which cannot be undone in a process); prints wall and system time per step and
the ratio. train.py and evaluate.py call it on every CPU run (models.builders.set_threads).

    python -m bench.malloc [--steps 8 --batch-size 16 --seq-len 256 --vocab 32000 --threads 1]
"""

import argparse
import os
import time

import torch

from bench.longce import step_fn
from data.heap import keep_freed_memory
from losses.ce import CrossEntropy
from models.backbone import build_llama
from models.lm import CausalLM


def time_steps(step, n: int) -> tuple[float, float]:
    """Mean (wall, system CPU) seconds per step over n steps, after one warm-up step."""
    step()
    wall, sys_time = time.perf_counter(), os.times().system
    for _ in range(n):
        step()
    return (time.perf_counter() - wall) / n, (os.times().system - sys_time) / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    backbone = build_llama(args.vocab, 64, 2, 4, 2, 256, args.seq_len)
    model = CausalLM(backbone, window=args.seq_len)
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    step = step_fn(model, CrossEntropy(), batch, torch.optim.AdamW(model.parameters(), lr=1e-3))

    before = time_steps(step, args.steps)
    if not keep_freed_memory():
        raise SystemExit("This C library has no mallopt (not glibc): nothing to compare.")
    after = time_steps(step, args.steps)
    for name, (wall, sys_time) in (("glibc default", before), ("keep_freed_memory", after)):
        print(
            f"{name:>18}: {wall * 1e3:7.1f} ms/step, system time {sys_time * 1e3:6.1f} ms ({sys_time / wall:.0%})"
        )
    print(f"speed-up: {before[0] / after[0]:.2f}x")


if __name__ == "__main__":
    main()
