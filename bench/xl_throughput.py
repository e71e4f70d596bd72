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
        vocab_size=args.vocab, hidden_size=args.hidden, n_layers=args.layers, n_heads=4, n_kv_heads=4,
        ffn_size=4 * args.hidden, max_positions=2 * args.segment, key_norm=xl, attn_scale=1.0 if xl else None,
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
        out = model(batch)
        F.cross_entropy(out.logits, out.targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        if step >= 2:
            best = max(best, B * L / (time.perf_counter() - t0))
    return best


def peak_memory_mib(fn, device: str) -> float:
    """Peak memory (MiB) above the level before `fn()`."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    proc, peak, stop = psutil.Process(), [0], threading.Event()
    before = proc.memory_info().rss

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
    return (max(peak[0], proc.memory_info().rss) - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segment", type=int, default=256, help="segment length L (baseline sequence length)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--doc-lengths", default="4096,16384,65536", help="comma-separated document lengths")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"baseline": build(args, xl=False), "llama_xl": build(args, xl=True)}

    L, D, n = args.segment, args.hidden, args.layers
    weights = sum(p.numel() for name, p in models["baseline"].named_parameters() if "embed_tokens" not in name)
    matmul = 6 * weights  # train FLOPs per token outside attention (fwd + bwd)
    attention = {"baseline": (L + 1) / 2, "llama_xl": L + (L + 1) / 2}  # keys per query
    expected = (matmul + 12 * n * D * attention["llama_xl"]) / (matmul + 12 * n * D * attention["baseline"])
    print(f"train step, B={args.batch} L={L} D={D} layers={n} V={args.vocab} on {args.device}:")
    rates = {name: train_tokens_per_s(m.train(), args) for name, m in models.items()}
    for name, rate in rates.items():
        print(f"  {name:9s} {rate:12,.0f} tokens/s")
    print(f"  llama_xl / baseline = {rates['llama_xl'] / rates['baseline']:.2f} (FLOP estimate: {1 / expected:.2f})")

    print(f"peak memory of ppl_by_position on one document ({args.device}, MiB above the pre-call level):")
    for length in [int(x) for x in args.doc_lengths.split(",")]:
        doc = torch.randint(0, args.vocab, (length,))
        edges = position_bins(length, 8, "log")
        row = []
        for name, model in models.items():
            t0 = time.perf_counter()
            mib = peak_memory_mib(lambda m=model: ppl_by_position(m, [doc], edges), args.device)
            row.append(f"{name} {mib:7.1f} MiB ({time.perf_counter() - t0:5.1f} s)")
        print(f"  {length:>6} tokens: " + "   ".join(row))


if __name__ == "__main__":
    main()
