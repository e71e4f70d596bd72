"""RMT-R's retrieval in a 1M-token BABILong evaluation against this CPU core's own limits (issue #14 asks for 100
samples x 1M tokens in <= 30 min on one core).

Before segment t the memory (B, m, D) attends over the bank's S = t*m past states: 4*m*S*D flops, and the bank (one
tensor, keys = values, models/rmt_retrieval.py) read once, 4*S*D bytes in fp32. Over the n segments of one sample
that is 2*m^2*D*n^2 flops and 2*m*D*n^2 bytes: n = 8,192 segments of 128 tokens (1M tokens), m = 8, D = 64 give
550 GFLOP and 69 GB a sample. This times MemoryRetrieval's forward (no grad, the evaluation batch of B rows) at
several bank sizes, fits a + b*S, sums it over the n segments, and prints it beside this core's floors: the flops at
its large-sgemm rate (MKL's best case, which m = 8 queries a row cannot beat) and the bytes at its read bandwidth.
Then the whole evaluation: RMT and RMT-R as `task=qa1` builds them (the tiny BABILong backbone) timed a segment with
the bank still small, plus the retrieval's growth (the b*S part), against the issue's 30 minutes.

    python -m bench.retrieval_floor [--batch 8] [--memory 8] [--hidden 64] [--segments 8192] [--samples 100]
"""

from __future__ import annotations

import argparse

import torch
from hydra import compose, initialize_config_dir
from torch import Tensor

from bench.babilong_gen import best_of
from models.builders import build_model, instantiate, register_resolvers
from models.cli import CONFIGS
from models.memory import MemoryBank
from models.rmt_retrieval import MemoryRetrieval


def by_formula(retrieval: MemoryRetrieval, memory: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """R_t by the paper's formula over projected keys and values (B, S, D) (the bank before it held LN(M))."""
    q = retrieval.q_proj(retrieval.norm_q(memory))
    scores = torch.baddbmm(torch.zeros(()), q, keys.transpose(1, 2), alpha=q.shape[-1] ** -0.5)
    r = memory + retrieval.o_proj(scores.softmax(-1) @ values)
    return r + retrieval.mlp(retrieval.norm_mlp(r))


def fit(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """a, b of seconds = a + b*S, least squares."""
    s, y = torch.tensor(sizes, dtype=torch.float64), torch.tensor(seconds, dtype=torch.float64)
    b = float(((s - s.mean()) * (y - y.mean())).sum() / ((s - s.mean()) ** 2).sum())
    return float(y.mean()) - b * float(s.mean()), b


def sample_seconds(sizes: list[int], seconds: list[float], m: int, n: int) -> float:
    """Seconds of the n segments of one batch: a + b*S summed over S = m, 2m, ..., n*m."""
    a, b = fit(sizes, seconds)
    return n * a + b * m * n * (n + 1) / 2


def segment_seconds(model_name: str, m: int, hidden: int, batch: int, segment: int, n: int) -> float:
    """Seconds a segment of a no-grad BABILong forward (answer scored at the last token) over n segments, of
    `python train.py model=<model_name> task=qa1` with m memory tokens, a backbone `hidden` wide, random weights."""
    overrides = [f"model={model_name}", "task=qa1", f"model.num_memory={m}", f"model.segment_size={segment}"]
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"backbone.hidden_size={hidden}"])
    torch.manual_seed(0)
    model = build_model(cfg, instantiate(cfg.tokenizer)).eval()
    ids = torch.randint(0, model.backbone.vocab_size, (batch, n * segment))
    labels = torch.full_like(ids, -100)
    labels[:, -1] = 1
    with torch.no_grad():
        return best_of(lambda: model({"input_ids": ids, "labels": labels}), 2) / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="evaluation rows a forward (eval.babilong.batch_size)"
    )
    parser.add_argument("--memory", type=int, default=8, help="m, memory tokens")
    parser.add_argument("--hidden", type=int, default=64, help="D, the backbone's width")
    parser.add_argument("--segments", type=int, default=8192, help="n, segments of one sample (1M / 128)")
    parser.add_argument("--segment", type=int, default=128, help="tokens a segment")
    parser.add_argument(
        "--timed-segments", type=int, default=64, help="segments a timed forward (bank still small)"
    )
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--sizes", default="4096,16384,65536", help="bank entries S to time")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, m, D, n = args.batch, args.memory, args.hidden, args.segments

    retrieval = MemoryRetrieval(D).eval()
    memory = torch.randn(B, m, D)
    sizes = [int(s) for s in args.sizes.split(",")]
    seconds: dict[str, list[float]] = {"module": [], "formula": []}
    print(
        f"Retrieval forward, B = {B}, m = {m}, D = {D}, fp32, {args.threads} thread(s); module: the bank of LN(M), "
        "formula: the paper's, banks of keys and values:"
    )
    with torch.no_grad():
        for S in sizes:
            states = torch.randn(B, S, D)
            bank = MemoryBank.start(retrieval.bank_entry(states), torch.ones(B, S, dtype=torch.bool))
            keys, values = retrieval.k_proj(bank.states), retrieval.v_proj(bank.states)
            diff = (retrieval(memory, bank) - by_formula(retrieval, memory, keys, values)).abs().max()
            t = best_of(lambda bank=bank: retrieval(memory, bank), args.repeats)
            t_ref = best_of(lambda k=keys, v=values: by_formula(retrieval, memory, k, v), args.repeats)
            seconds["module"].append(t)
            seconds["formula"].append(t_ref)
            flops = B * 4 * m * S * D
            print(
                f"  S = {S:6d}: module {t * 1e3:7.2f} ms ({flops / t / 1e9:5.1f} GFLOP/s), formula "
                f"{t_ref * 1e3:7.2f} ms: x{t_ref / t:.2f}; max |difference| {diff:.1e}"
            )
    per_sample = {name: sample_seconds(sizes, ts, m, n) / B for name, ts in seconds.items()}

    big = torch.randn(1024, 1024)
    gemm_rate = 2 * 1024**3 / best_of(lambda: big @ big, args.repeats)
    stream = torch.randn(B, 65536, D)  # larger than any cache
    read_rate = stream.numel() * 4 / best_of(stream.sum, args.repeats)
    flops, nbytes = 2 * m * m * D * n * n, 2 * m * D * n * n
    floor = max(flops / gemm_rate, nbytes / read_rate)
    print(f"This core: sgemm 1024^3 {gemm_rate / 1e9:.1f} GFLOP/s, read {read_rate / 1e9:.1f} GB/s")
    print(
        f"One sample of {n} segments: {flops / 1e9:.0f} GFLOP, {nbytes / 1e9:.0f} GB of bank reads; "
        f"floors {flops / gemm_rate:.1f} s (flops) / {nbytes / read_rate:.1f} s (bytes)"
    )
    for name, t in per_sample.items():
        print(
            f"Retrieval, {args.samples} samples, {name}: {t * args.samples / 60:.1f} min "
            f"(x{t / floor:.2f} the floor of {floor * args.samples / 60:.1f} min)"
        )

    minutes = args.samples / B * n / 60  # seconds a segment of B rows -> minutes for all samples
    register_resolvers()
    rmt, rmt_r = (
        segment_seconds(name, m, D, B, args.segment, args.timed_segments) * minutes
        for name in ("rmt", "rmt_r")
    )
    # the retrieval's b*S part over S = m, 2m, ..., n*m (its a part is in the small-bank segments)
    growth = fit(sizes, seconds["module"])[1] * m * (n + 1) / 2 * minutes
    print(
        f"Whole evaluation, {args.samples} samples x {n} segments of {args.segment} tokens, B = {B}: segments with "
        f"a small bank RMT {rmt:.1f} min, RMT-R {rmt_r:.1f} min; RMT-R with the bank's growth {rmt_r + growth:.1f} "
        f"min, at the retrieval's floor {rmt_r + floor * args.samples / 60:.1f} min (issue #14: 30 min)"
    )


if __name__ == "__main__":
    main()
