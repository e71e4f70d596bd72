"""RMT-R's retrieval at the bank sizes of long streams (a 1M-token input of 128-token segments ends with 65,536
entries: 8,192 states of 8 memory tokens): `MemoryRetrieval.forward` (the bank holds LN(M_j) once; W_K folds into
the query, W_V after the weighted sum; one fused attention) against the paper's formula written out over a bank of
projected keys and values (mask + q K^T / sqrt(d) as one `baddbmm`, softmax, `bmm` with V, then W_O and the MLP),
same weights and states; no gradients, one thread:

    python -m bench.retrieval [--rows 4] [--memory 8] [--dim 64] [--sizes 8192 32768 65536] [--reps 20]

Prints milliseconds per call each way, their ratio, the largest difference of the outputs, and the bank's bytes.
"""

from __future__ import annotations

import argparse
import time

import torch

from models.memory import MemoryBank
from models.rmt_retrieval import MemoryRetrieval


def written_out(r: MemoryRetrieval, memory: torch.Tensor, keys, values, valid) -> torch.Tensor:
    """R_t by the paper's formula over projected keys and values (B, S, D): the retrieval before the folding."""
    q = r.q_proj(r.norm_q(memory))
    mask = q.new_zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, :]
    att = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=q.shape[-1] ** -0.5).softmax(-1)
    out = memory + r.o_proj(att @ values)
    return out + r.mlp(r.norm_mlp(out))


def ms_per_call(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--memory", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    r = MemoryRetrieval(a.dim).eval()
    memory = torch.randn(a.rows, a.memory, a.dim)
    print(f"rows {a.rows}, memory tokens {a.memory}, width {a.dim}, one thread")
    with torch.no_grad():
        for size in a.sizes:
            states = torch.randn(a.rows, size, a.dim)
            valid = torch.ones(a.rows, size, dtype=torch.bool)
            normalised = r.normalised(states)
            keys, values = r.k_proj(normalised), r.v_proj(normalised)
            bank = MemoryBank.start(normalised, valid)
            diff = (r(memory, bank) - written_out(r, memory, keys, values, valid)).abs().max().item()
            fused = ms_per_call(lambda bank=bank: r(memory, bank), a.reps)
            before = ms_per_call(lambda k=keys, v=values, m=valid: written_out(r, memory, k, v, m), a.reps)
            print(
                f"bank of {size:,} entries: folded {fused:.2f} ms, written out {before:.2f} ms, "
                f"{before / fused:.2f}x; max |difference| {diff:.1e}; bank {normalised.nbytes / 2**20:.0f} "
                f"MiB against {(keys.nbytes + values.nbytes) / 2**20:.0f} MiB of keys and values"
            )


if __name__ == "__main__":
    main()
