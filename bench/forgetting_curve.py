"""Overhead of `forgetting_curve` (sampling, input building, scoring, progress) over the bare forwards it needs.

A small random-weight `models.llama.Llama` is run (a) through `forgetting_curve` and (b) on exactly the batches
that call sends to `predict` (recorded once beforehand), and the two times are
compared. Target: ratio <= 1.1. Runs are interleaved per length and the best of `--repeats` is kept per length,
since other processes make timings noisy on a shared CPU; the script also times `forgetting_curve` with a free
predictor (its overhead alone) and prints (bare + overhead) / bare.

    /work/venv/bin/python -m bench.forgetting_curve [--max-len 512] [--n-lengths 8] [--device cpu]
"""

import argparse
import time

import torch

from callbacks.forgetting_curve import forgetting_curve, length_grid
from models.llama import Llama, LlamaConfig

BOS, EOS = 1, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--n-lengths", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=10)
    parser.add_argument("--stream", type=int, default=1_000_000, help="held-out stream length (tokens)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared CPU)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_size=4 * args.hidden,
        max_positions=2 * args.max_len + 3,
    )
    model = Llama(cfg).to(args.device).eval()
    tokens = torch.randint(3, cfg.vocab_size, (args.stream,))
    lengths = length_grid(args.max_len, n=args.n_lengths)

    def predict(input_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T)
        return model.logits(input_ids.to(args.device)).argmax(-1)

    batches = {}

    def recording_predict(input_ids: torch.Tensor) -> torch.Tensor:
        batches[(input_ids.shape[1] - 3) // 2] = input_ids
        return predict(input_ids)

    def run(fn) -> float:
        start = time.perf_counter()
        fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def curve(predictor, grid, progress: bool = False) -> None:
        forgetting_curve(predictor, tokens, grid, args.n_samples, bos_id=BOS, eos_id=EOS, progress=progress)

    @torch.no_grad()
    def bare(length: int) -> None:
        predict(batches[length])

    # Warm-up; records the batches. A length's samples do not depend on the rest of the grid, so timing one
    # length at a time below sends exactly these batches.
    curve(recording_predict, lengths)
    times: dict[str, list[list[float]]] = {"bare": [], "curve": [], "overhead": []}
    for _ in range(args.repeats):  # interleaved per length, so load from other processes hits both alike
        times["bare"].append([])
        times["curve"].append([])
        for i, n in enumerate(lengths):
            pair = [("bare", lambda n=n: bare(n)), ("curve", lambda n=n: curve(predict, [n]))]
            for name, fn in pair[:: 1 if i % 2 else -1]:  # alternate which goes first
                times[name][-1].append(run(fn))
        times["overhead"].append([run(lambda: curve(torch.zeros_like, lengths, progress=True))])

    print(f"device={args.device} lengths={lengths} n_samples={args.n_samples} stream={args.stream:,} tokens")
    print(
        f"model: {cfg.n_layers} layers, width {cfg.hidden_size}, {model.num_parameters() / 1e6:.2f}M params"
    )
    best = {name: sum(map(min, zip(*runs, strict=True))) for name, runs in times.items()}  # best per length
    print(f"best of {args.repeats} runs per length, summed over lengths:")
    print(f"  bare forwards        {best['bare']:.3f}s")
    print(f"  forgetting_curve     {best['curve']:.3f}s")
    print(
        f"  overhead alone       {best['overhead']:.3f}s (whole grid, progress bar on, predict = zeros_like)"
    )
    print(f"ratio forgetting_curve / bare forwards: {best['curve'] / best['bare']:.3f} (target <= 1.1)")
    print(f"ratio (bare + overhead alone) / bare:   {(best['bare'] + best['overhead']) / best['bare']:.3f}")


if __name__ == "__main__":
    main()
