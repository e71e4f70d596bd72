"""Llama-XL cost against the baseline CausalLM with the same small random-weight Llama.

1. Train-step throughput (forward + CE + backward + AdamW) at the same segment length L: the baseline attends over
   L causal keys, Llama-XL over [cache (L); segment (L)]. Attention FLOPs per query grow from (L+1)/2 to
   L + (L+1)/2 keys, so the expected ratio depends on how much of a step attention is (printed).
2. Peak memory of `ppl_by_position` on one document of growing length (up to 64k tokens) for Llama-XL (segment by
   segment with its cache) and the baseline (sliding window of L, stride L/2): it should stay flat. On CPU, peak
   RSS above the pre-call RSS, sampled every millisecond; on GPU, torch.cuda.max_memory_allocated above the
   pre-call allocation.

    /work/venv/bin/python -m bench.xl_throughput [--segment 256] [--batch 4] [--device cpu]
"""

import argparse
import multiprocessing
import threading
import time

import psutil
import torch
import torch.nn.functional as F

from callbacks.ppl_by_position import position_bins, ppl_by_position
from models.llama import Llama, LlamaConfig
from models.llama_xl import LlamaXL
from models.lm import CausalLM


def build(args, xl: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_size=4 * args.hidden,
        max_positions=2 * args.segment,
        key_norm=xl,
        attn_scale=1.0 if xl else None,
    )
    if xl:
        return LlamaXL(Llama(cfg), args.segment, cache_segments=1).to(args.device)
    return CausalLM(Llama(cfg), window=args.segment).to(args.device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_tokens_per_s(model: torch.nn.Module, args) -> float:
    """Best tokens/s over `--steps` timed train steps on one continuing stream (after 2 warm-up steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, L = args.batch, args.segment
    best = 0.0
    for step in range(args.steps + 2):
        ids = torch.randint(0, args.vocab, (B, L + 1), device=args.device)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "reset": torch.full((B,), step == 0)}
        sync(args.device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
            out = model(batch)
        F.cross_entropy(out.logits.float(), out.targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        if step >= 2:
            best = max(best, B * L / (time.perf_counter() - t0))
    return best


def peak_memory_mib(fn, device: str, rss_base: int) -> float:
    """Peak memory (MiB) while `fn()` runs: above `rss_base` bytes on CPU, above the pre-call level on GPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
    return (max(peak[0], proc.memory_info().rss) - rss_base) / 2**20


def memory_curve(name: str, args, lengths: list[int]) -> list[tuple[float, float]]:
    """(peak MiB, seconds) of ppl_by_position on one random document per length, ascending, for one model."""
    torch.set_num_threads(args.threads)
    model = build(args, xl=name == "llama_xl")
    rss_base = psutil.Process().memory_info().rss
    curve = []
    for length in lengths:
        doc, edges = torch.randint(0, args.vocab, (length,)), position_bins(length, 8)
        t0 = time.perf_counter()
        mib = peak_memory_mib(lambda d=doc, e=edges: ppl_by_position(model, [d], e), args.device, rss_base)
        curve.append((mib, time.perf_counter() - t0))
    return curve


def in_own_process(fn, *fn_args):
    """fn(*fn_args), in a forked process on CPU so that its RSS reflects that call alone."""
    if fn_args[1].device != "cpu":
        return fn(*fn_args)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(fn, fn_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--segment", type=int, default=256, help="segment length L = baseline sequence length"
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--doc-lengths", default="4096,16384,65536", help="comma-separated document lengths")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L, D, n = args.segment, args.hidden, args.layers

    models = {"baseline": build(args, xl=False), "llama_xl": build(args, xl=True)}
    weights = sum(p.numel() for k, p in models["baseline"].named_parameters() if "embed_tokens" not in k)
    keys = {"baseline": (L + 1) / 2, "llama_xl": L + (L + 1) / 2}  # attended keys per query
    flops = {name: 6 * weights + 12 * n * D * k for name, k in keys.items()}  # train FLOPs per token
    print(f"train step, B={args.batch} L={L} D={D} layers={n} V={args.vocab} on {args.device}:")
    rates = {name: train_tokens_per_s(m.train(), args) for name, m in models.items()}
    for name, rate in rates.items():
        print(f"  {name:9s} {rate:12,.0f} tokens/s")
    ratio, expected = rates["llama_xl"] / rates["baseline"], flops["baseline"] / flops["llama_xl"]
    print(f"  llama_xl / baseline = {ratio:.2f} (FLOP estimate {expected:.2f})")
    del models

    lengths = [int(x) for x in args.doc_lengths.split(",")]
    where = (
        "peak RSS above the RSS once built, own process" if args.device == "cpu" else "peak above pre-call"
    )
    print(f"memory of ppl_by_position on one document ({args.device}, MiB, {where}):")
    curves = {name: in_own_process(memory_curve, name, args, lengths) for name in ("baseline", "llama_xl")}
    for i, length in enumerate(lengths):
        row = "   ".join(f"{name} {c[i][0]:7.1f} MiB ({c[i][1]:5.1f} s)" for name, c in curves.items())
        print(f"  {length:>6} tokens: {row}")


if __name__ == "__main__":
    main()
