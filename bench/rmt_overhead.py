"""RMT / RMT-R overhead: train-step time against the bare backbone over the same tokens, and the peak memory of
streaming evaluation as the input grows.

1. Train step (forward + backward, CE at every token) on B rows of n segments of L tokens:
   - `backbone`: the bare backbone over the whole n*L-token rows (what a long-context model would run);
   - `backbone/seg`: the bare backbone over the same tokens cut into n independent L-token rows (same attention
     span as RMT, no memory): the fair baseline for the cost of recurrence;
   - `rmt`, `rmt_r`: m memory tokens, segment by segment, full backprop through time.
   Ratios are to both baselines; the target is rmt <= 1.10x backbone/seg (memory adds 2m/L tokens a segment).
2. Streaming evaluation (`iter_logits`, every chunk consumed and dropped) at each length of --stream-lengths, each
   in its own subprocess so that the peak resident memory (VmHWM) belongs to one length; on CUDA the peak
   allocated memory. RMT's should be flat; RMT-R's grows by its n x m x d bank. Then one BABILong-style forward
   (answer scored at the last position only, no grad) of the longest length, timed.

Run from the repo root: /work/venv/bin/python -m bench.rmt_overhead [--hidden 128 --layers 4 --segment 512 ...]
(CPU defaults take a few minutes on one thread; on a GPU, --hidden 768 --layers 12 is GPT-2 small's shape.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig
from models.lm import CausalLM
from models.rmt import RMT
from models.rmt_retrieval import RMTRetrieval


def build(kind: str, args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        ffn_size=4 * args.hidden,
        max_positions=args.segment * args.segments,
    )
    backbone = Llama(cfg)
    if kind == "rmt":
        return RMT(backbone, args.memory, args.segment)
    if kind == "rmt_r":
        return RMTRetrieval(backbone, args.memory, args.segment)
    return CausalLM(backbone, window=args.segment * args.segments)


def train_step_seconds(args, device: str) -> dict[str, float]:
    """Best-of-repeats seconds of one training step per model, runs interleaved (shared CPUs load all alike)."""
    B, n, L = args.batch, args.segments, args.segment
    ids = torch.randint(0, args.vocab, (B, n * L), device=device)
    batches = {
        "backbone": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "backbone/seg": {"input_ids": ids.view(B * n, L), "labels": ids.roll(-1, 1).view(B * n, L)},
        "rmt": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "rmt_r": {"input_ids": ids, "labels": ids.roll(-1, 1)},
    }
    models = {name: build(name.split("/")[0], args).to(device) for name in batches}
    times = {name: [] for name in batches}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, model in models.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                out = model(batches[name])
                loss = F.cross_entropy(out.logits.float(), out.targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(t[1:]) for name, t in times.items()}


def stream_peak(args, kind: str, length: int, device: str) -> dict:
    """In a fresh process: stream `length` tokens through iter_logits; peak memory and seconds."""
    model = build(kind, args).to(device).eval()
    ids = torch.randint(0, args.vocab, (1, length), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    n = sum(int(chunk.argmax(-1).numel()) for chunk in model.iter_logits(ids))
    assert n == length
    seconds = time.perf_counter() - start
    if device == "cuda":
        return {"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "seconds": seconds}
    return {"peak_mb": peak_rss_mb(), "seconds": seconds}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the parent's, kept across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def answer_forward_seconds(args, length: int, device: str) -> float:
    """One BABILong-style evaluation forward of `length` tokens (answer at the last position), no grad."""
    model = build("rmt", args).to(device).eval()
    ids = torch.randint(0, args.vocab, (1, length), device=device)
    labels = torch.full_like(ids, -100)
    labels[0, -1] = 0
    start = time.perf_counter()
    with torch.no_grad():
        model({"input_ids": ids, "labels": labels})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--segment", type=int, default=512)
    parser.add_argument("--memory", type=int, default=16)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-lengths", default="16384,1048576")
    parser.add_argument(
        "--stream-vocab", type=int, default=512, help="vocabulary for streaming (logits of all tokens)"
    )
    parser.add_argument("--stream-hidden", type=int, default=64)
    parser.add_argument("--stream-layers", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: stable timings on shared cores)"
    )
    parser.add_argument("--stream-child", default=None, help=argparse.SUPPRESS)  # kind:length, internal
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    stream_args = argparse.Namespace(
        **{
            **vars(args),
            "vocab": args.stream_vocab,
            "hidden": args.stream_hidden,
            "layers": args.stream_layers,
        }
    )
    if args.stream_child:
        kind, length = args.stream_child.split(":")
        print(json.dumps(stream_peak(stream_args, kind, int(length), device)))
        return

    times = train_step_seconds(args, device)
    print(
        f"Train step, {args.batch} x {args.segments} segments x {args.segment} tokens, hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}, m = {args.memory}, {device}:"
    )
    for name, t in times.items():
        print(
            f"  {name:13s} {t * 1000:9.1f} ms   x{t / times['backbone']:.2f} vs backbone   "
            f"x{t / times['backbone/seg']:.2f} vs backbone/seg"
        )

    lengths = [int(x) for x in args.stream_lengths.split(",")]
    print(
        f"Streaming iter_logits, hidden {args.stream_hidden}, {args.stream_layers} layers, vocab {args.stream_vocab}:"
    )
    for kind in ("rmt", "rmt_r"):
        for length in lengths:
            cmd = [
                sys.executable,
                "-m",
                "bench.rmt_overhead",
                *sys.argv[1:],
                "--stream-child",
                f"{kind}:{length}",
            ]
            res = json.loads(
                subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
            )
            print(
                f"  {kind:6s} {length:>9,d} tokens: peak {res['peak_mb']:8.1f} MB   {res['seconds']:7.1f} s"
            )
    longest = max(lengths)
    print(
        f"BABILong-style RMT forward of {longest:,} tokens (answer scored at the end): "
        f"{answer_forward_seconds(stream_args, longest, device):.1f} s"
    )


if __name__ == "__main__":
    main()
