"""Train-step throughput: our Lightning loop vs a hand-written torch loop (same model, batch, optimizer, clipping),
and our Llama vs Hugging Face LlamaForCausalLM (same config and weights). On CUDA both loops run in bf16 autocast
(Lightning's `bf16-mixed`) and print the model FLOP utilisation (MFU: 6 x non-embedding parameters + causal
attention FLOPs per token, over the GPU's dense bf16 peak).

    python -m bench.throughput [--hidden 256 --layers 4 --vocab 8000 --seq 256 --batch 8 --steps 30]
    python -m bench.throughput --preset llama_83m --batch 16 --compile     # the Llama-83M baseline on a GPU

Targets: Lightning / torch time ratio <= 1.05; our Llama >= 1.0x HF speed; Llama-83M >= 40% MFU in bf16 on a GPU.
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
from transformers import LlamaForCausalLM

from losses.ce import CrossEntropy
from models.lit_module import LitModule
from models.llama import Llama, LlamaConfig
from models.lm import CausalLM

PRESETS = {  # name: Llama shape (the backbone configs of the same name)
    "llama_83m": dict(hidden=512, layers=12, heads=8, vocab=32000, seq=1024),
}
# Dense bf16 peak FLOP/s by GPU name (datasheets; SXM parts), for MFU.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12}


def make_batch(vocab: int, batch: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def train_flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """6 x the matmul parameters (all but the embedding table) + causal attention (QK^T and AV: 6 L T D)."""
    matmul_params = Llama(cfg).num_parameters() - cfg.vocab_size * cfg.hidden_size
    return 6 * matmul_params + 6 * cfg.n_layers * seq * cfg.hidden_size


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


class Timer(L.Callback):
    """Wall time from the end of the warm-up steps to the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.t0, self.t1 = warmup, None, None

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.warmup:
            sync(trainer.strategy.root_device.type)
            self.t0 = time.perf_counter()
        sync(trainer.strategy.root_device.type)
        self.t1 = time.perf_counter()


def lightning_loop(model: CausalLM, batch: dict, steps: int, warmup: int, device: str) -> float:
    module = LitModule(model, CrossEntropy(), lr=1e-4, warmup_steps=1)
    timer = Timer(warmup)
    trainer = L.Trainer(
        max_steps=steps + warmup,
        accelerator=device,
        devices=1,
        precision="bf16-mixed" if device == "cuda" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[timer],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        module, train_dataloaders=torch.utils.data.DataLoader([batch] * (steps + warmup), batch_size=None)
    )
    return timer.t1 - timer.t0


def torch_loop(model: CausalLM, batch: dict, steps: int, warmup: int, device: str) -> float:
    """What LitModule does by hand: forward, CE, backward, clip 1.0, AdamW step, LR schedule step (bf16 autocast
    and fused AdamW on CUDA, as LitModule under `bf16-mixed`)."""
    model.to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loss_fn, batch = CrossEntropy(), {k: v.to(device) for k, v in batch.items()}
    for i in range(steps + warmup):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = loss_fn(model(batch), model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss.item()  # Lightning reads the loss every step too
    sync(device)
    return time.perf_counter() - t0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fwd_bwd_time(fn, ids: torch.Tensor, steps: int, warmup: int, device: str) -> float:
    for i in range(steps + warmup):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = fn(ids)
        out.float().logsumexp(-1).mean().backward()
    sync(device)
    return time.perf_counter() - t0


def task_model(cfg: LlamaConfig, compile: bool) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(Llama(cfg))
    if compile:
        model.backbone.compile()  # in place: same module names and state dict, as train.py's compile=true
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", choices=list(PRESETS), default=None, help="a named model shape (overrides sizes)"
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile the backbone in both loops")
    p.add_argument("--skip-hf", action="store_true", help="skip the comparison with Hugging Face Llama")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    for k, v in PRESETS.get(a.preset, {}).items():
        setattr(a, k, v)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        n_layers=a.layers,
        n_heads=a.heads,
        n_kv_heads=a.heads,
        ffn_size=4 * a.hidden,
        max_positions=max(2048, a.seq),
    )
    batch, tokens = make_batch(a.vocab, a.batch, a.seq), a.batch * a.seq * a.steps
    gpu = f" ({torch.cuda.get_device_name()}, bf16 autocast)" if device == "cuda" else ""
    print(
        f"device={device}{gpu} threads={torch.get_num_threads()} compile={a.compile} model={cfg} "
        f"batch={a.batch}x{a.seq} steps={a.steps}"
    )
    flops, peak = train_flops_per_token(cfg, a.seq), peak_flops()

    def report(name: str, seconds: float) -> None:
        rate = tokens / seconds
        mfu = f"   MFU {rate * flops / peak:6.1%}" if peak else ""
        print(f"train step, {name:27s} {rate:12,.0f} tokens/s{mfu}")

    t_torch = torch_loop(task_model(cfg, a.compile), batch, a.steps, a.warmup, device)
    t_light = lightning_loop(task_model(cfg, a.compile), batch, a.steps, a.warmup, device)
    report("hand-written torch loop:", t_torch)
    report("our Lightning loop:", t_light)
    print(f"Lightning / torch time ratio: {t_light / t_torch:.3f}  (target <= 1.05)")
    if a.skip_hf:
        return

    ours = Llama(cfg).to(device)
    hf = LlamaForCausalLM(ours.hf_config()).to(device)
    hf.load_state_dict(ours.to_hf_state_dict())
    ids = batch["input_ids"].to(device)
    t_ours = fwd_bwd_time(ours.logits, ids, a.steps, a.warmup, device)
    t_hf = fwd_bwd_time(lambda x: hf(x).logits, ids, a.steps, a.warmup, device)
    print(f"forward+backward, our Llama: {tokens / t_ours:12,.0f} tokens/s")
    print(f"forward+backward, HF Llama:  {tokens / t_hf:12,.0f} tokens/s")
    print(f"our speed / HF speed: {t_hf / t_ours:.3f}  (target >= 1.0)")


if __name__ == "__main__":
    main()
