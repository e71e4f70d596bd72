"""LongCE vs CE training-step time (forward, loss, backward, AdamW step) of CausalLM on random tokens.

LongCE adds one no-grad pass over the sliding windows (K + d - 1 tokens each, the vocabulary only on their last d
positions). Two models at their training lengths: the tiny Llama of experiment=tiny_lm (seq 256, batch 16) and the
Llama-83M baseline (seq 1024, batch 1). Steps are interleaved CE / LongCE and the best of --repeats is kept (wall
and process CPU time; with one thread on a shared CPU the CPU time is the steadier). Target: LongCE / CE <= 1.35
at the default settings (configs/loss/longce.yaml: K = d = a quarter of the training length).

    /work/venv/bin/python -m bench.longce [--K 64 --d 64 --repeats 5 --threads 1]
"""

import argparse

import torch

from bench.longppl import best_times
from losses.ce import CrossEntropy
from losses.longce import LongCE
from models.backbone import build_llama
from models.lm import CausalLM

MODELS = {  # name: (backbone arguments, seq_len, batch_size)
    "tiny": (dict(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=256), 256, 16),
    "llama_83m": (dict(hidden_size=512, n_layers=12, n_heads=8, n_kv_heads=8, ffn_size=2048), 1024, 1),
}


def step_fn(model: CausalLM, loss_fn, batch: dict, optimizer: torch.optim.Optimizer):
    device = batch["input_ids"].device.type

    def step() -> None:  # bf16 autocast on CUDA, as training there (`bf16-mixed`)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = loss_fn(model(batch), model, batch)
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--K", type=int, default=None, help="default: a quarter of the sequence length")
    parser.add_argument("--d", type=int, default=None, help="default: K")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steadier timings on shared cores)"
    )
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    for name in args.models:
        kwargs, seq_len, batch_size = MODELS[name]
        torch.manual_seed(0)
        backbone = build_llama(vocab_size=args.vocab, max_positions=2048, **kwargs)
        model = CausalLM(backbone, window=seq_len).to(device).train()
        chunks = torch.randint(3, args.vocab, (batch_size, seq_len + 1), device=device)
        batch = {"input_ids": chunks[:, :-1], "labels": chunks[:, 1:]}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ce = step_fn(model, CrossEntropy(), batch, optimizer)
        longce = step_fn(model, LongCE(gamma=5.0, K=args.K, d=args.d), batch, optimizer)
        (ce_wall, ce_cpu), (lce_wall, lce_cpu) = best_times([ce, longce], args.repeats)
        n_params = sum(p.numel() for p in model.parameters())
        K = seq_len // 4 if args.K is None else args.K
        print(
            f"{name} ({n_params / 1e6:.1f}M params) on {device}, batch {batch_size} x {seq_len}, K={K} "
            f"d={K if args.d is None else args.d}: CE {ce_wall * 1e3:.0f} ms wall / {ce_cpu * 1e3:.0f} ms cpu, LongCE {lce_wall * 1e3:.0f} "
            f"ms wall / {lce_cpu * 1e3:.0f} ms cpu -> ratio {lce_wall / ce_wall:.3f} wall, {lce_cpu / ce_cpu:.3f} cpu"
        )


if __name__ == "__main__":
    main()
