"""Train-step throughput: our Lightning loop vs a hand-written torch loop (same model, batch, optimizer, clipping),
and our Llama vs Hugging Face LlamaForCausalLM (same config and weights).

    python -m bench.throughput [--hidden 256 --layers 4 --vocab 8000 --seq 256 --batch 8 --steps 30]

Targets: Lightning / torch time ratio <= 1.05; our Llama >= 1.0x HF speed.
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


def make_batch(vocab: int, batch: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


class Timer(L.Callback):
    """Wall time from the end of the warm-up steps to the end of the last step."""

    def __init__(self, warmup: int):
        self.warmup, self.t0, self.t1 = warmup, None, None

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()
        self.t1 = time.perf_counter()


def lightning_loop(model: CausalLM, batch: dict, steps: int, warmup: int, device: str) -> float:
    module = LitModule(model, CrossEntropy(), lr=1e-4, warmup_steps=1)
    timer = Timer(warmup)
    trainer = L.Trainer(
        max_steps=steps + warmup,
        accelerator=device,
        devices=1,
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
    """What LitModule does by hand: forward, CE, backward, clip 1.0, AdamW step, LR schedule step."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loss_fn, batch = CrossEntropy(), {k: v.to(device) for k, v in batch.items()}
    for i in range(steps + warmup):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
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
        fn(ids).float().logsumexp(-1).mean().backward()
    sync(device)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
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
    print(
        f"device={device} threads={torch.get_num_threads()} model={cfg} batch={a.batch}x{a.seq} steps={a.steps}"
    )

    torch.manual_seed(0)
    t_torch = torch_loop(CausalLM(Llama(cfg)), batch, a.steps, a.warmup, device)
    torch.manual_seed(0)
    t_light = lightning_loop(CausalLM(Llama(cfg)), batch, a.steps, a.warmup, device)
    print(f"train step, hand-written torch loop: {tokens / t_torch:10.0f} tokens/s")
    print(f"train step, our Lightning loop:      {tokens / t_light:10.0f} tokens/s")
    print(f"Lightning / torch time ratio: {t_light / t_torch:.3f}  (target <= 1.05)")

    ours = Llama(cfg).to(device)
    hf = LlamaForCausalLM(ours.hf_config()).to(device)
    hf.load_state_dict(ours.to_hf_state_dict())
    ids = batch["input_ids"].to(device)
    t_ours = fwd_bwd_time(ours.logits, ids, a.steps, a.warmup, device)
    t_hf = fwd_bwd_time(lambda x: hf(x).logits, ids, a.steps, a.warmup, device)
    print(f"forward+backward, our Llama: {tokens / t_ours:10.0f} tokens/s")
    print(f"forward+backward, HF Llama:  {tokens / t_hf:10.0f} tokens/s")
    print(f"our speed / HF speed: {t_hf / t_ours:.3f}  (target >= 1.0)")


if __name__ == "__main__":
    main()
