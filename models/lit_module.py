"""The one LightningModule: drives any task model with an injected loss, AdamW and the WSD schedule.

Task models (CausalLM, RMT, RMT-R, Llama-XL) differ by the module passed in, never by subclassing this.
Metrics: `train/loss`, `train/lr`, `train/tokens_per_s`, plus `train/<name>` for what the loss reports in its
`logged` dict (LongCE: the plain `train/ce` and its weights); validation `val/loss`, `val/ppl` for language
modelling and `val/<name>/acc` (exact match of the answer) for question-answering batches (those carrying
`answer_mask`).
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from callbacks.checkpoint import DivergedError
from models.config_checks import check_checkpoint_fits
from models.outputs import scored_positions


def wsd_lambda(warmup_steps: int, total_steps: int, stable_ratio: float, min_lr_ratio: float):
    """Warmup-stable-decay multiplier: linear warmup, constant for `stable_ratio` of the rest, linear decay."""
    decay_start = warmup_steps + int(stable_ratio * max(0, total_steps - warmup_steps))

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step < decay_start or total_steps <= decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / (total_steps - decay_start))
        return 1.0 - (1.0 - min_lr_ratio) * progress

    return f


class LitModule(L.LightningModule):
    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        stable_ratio: float = 0.8,
        min_lr_ratio: float = 0.0,
        config: dict | None = None,
    ):
        super().__init__()
        self.model, self.loss = model, loss
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.warmup_steps, self.stable_ratio, self.min_lr_ratio = warmup_steps, stable_ratio, min_lr_ratio
        self.config = config  # the run's resolved config: travels inside every checkpoint
        self._means: dict[str, MeanMetric] = {}  # per evaluation set and metric, reset every evaluation
        self._t_last: float | None = None
        self._loss: Tensor | None = None  # this step's loss, checked with the gradients before the update
        self._saving_mid_step = False  # True while last-finite.ckpt is written before an optimizer step

    # ---- training -------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        out = self.model(batch)
        loss = self.loss(out, self.model, batch)
        self._loss = loss.detach()
        n_tok = (
            int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        )
        self.log("train/loss", loss, prog_bar=True)
        for name, value in getattr(self.loss, "logged", {}).items():
            self.log(f"train/{name}", value)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self._log_throughput(n_tok)
        return loss

    def _log_throughput(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self.log("train/tokens_per_s", n_tokens / max(now - self._t_last, 1e-9), prog_bar=True)
        self._t_last = now

    def on_before_optimizer_step(self, optimizer) -> None:
        """Stop before an update with a non-finite loss or gradient norm: the weights and optimizer state are then
        still the last good ones; they are saved to last-finite.ckpt (a GradScaler skips inf steps by itself)."""
        loss = self._loss if self._loss is not None else torch.zeros((), device=self.device)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
        norm = (
            torch.nn.utils.get_total_norm(grads)
            if grads and not scaled
            else torch.zeros((), device=loss.device)
        )
        loss_finite = torch.isfinite(loss).all()
        finite = bool(loss_finite & torch.isfinite(norm))  # one device sync per step
        if not self.trainer.strategy.reduce_boolean_decision(not finite, all=False):
            return
        what = f"Loss is {loss.item()}" if not loss_finite else f"The gradient norm is {norm.item()}"
        raise DivergedError(f"{what} at global step {self.global_step}. {self._save_last_finite()}")

    def _save_last_finite(self) -> str:
        ckpt = self.trainer.checkpoint_callback
        if ckpt is None or not ckpt.dirpath:
            return "Lower the learning rate (optim.lr) or check the data."
        path = f"{ckpt.dirpath}/last-finite.ckpt"
        self._saving_mid_step = True
        try:
            self.trainer.save_checkpoint(path, weights_only=False)  # the full state, to resume from
        except DivergedError:  # the state before this step holds NaN/inf already: nothing good to save
            return (
                f"The state before this step is not finite either, so nothing was saved; the checkpoints in "
                f"{ckpt.dirpath} are the last good states. Lower the learning rate (optim.lr) and resume from one."
            )
        finally:
            self._saving_mid_step = False
        return (
            f"The last good state was saved to {path}. Lower the learning rate (optim.lr), check the data, or resume "
            "from it with ckpt_path=<that file>."
        )

    # ---- validation / test --------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._means = {}
        self._t_last = None

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, dataloader_idx, "val")

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, dataloader_idx, "test")

    def _eval_step(self, batch: dict, dataloader_idx: int, stage: str) -> None:
        """Means per evaluation set (torchmetrics, synced across processes): NLL over scored tokens, and exact match per sample for QA batches.

        Unnamed sets log `val/loss`, `val/ppl` (and `val/acc`); a set the datamodule names `qa1/acc@4seg` (its
        `val_names` / `test_names`) logs `val/qa1/acc@4seg` and `val/qa1/loss@4seg`.
        """
        out = self.model(batch)
        nll = nn.functional.cross_entropy(out.logits.float(), out.targets, reduction="sum").detach()
        names = getattr(self.trainer.datamodule, f"{stage}_names", None) or []
        name = names[dataloader_idx] if dataloader_idx < len(names) else None
        acc_key = f"{stage}/{name}" if name else f"{stage}/acc"
        loss_key = acc_key.replace("/acc@", "/loss@") if name else f"{stage}/loss"
        self._metric(loss_key).update(nll / out.targets.numel(), weight=out.targets.numel())
        if "answer_mask" in batch:
            self._metric(acc_key).update(exact_match(out.logits, out.targets, batch))

    def _metric(self, key: str) -> MeanMetric:
        if key not in self._means:
            self._means[key] = MeanMetric(sync_on_compute=True).to(self.device)
        return self._means[key]

    def on_validation_epoch_end(self) -> None:
        for key, metric in sorted(self._means.items()):
            mean = metric.compute().float()
            self.log(key, mean, prog_bar=key.endswith("/loss") or "/acc" in key, add_dataloader_idx=False)
            if key.endswith("/loss"):
                self.log(
                    key[: -len("loss")] + "ppl",
                    torch.exp(mean.clamp(max=50)),
                    prog_bar=True,
                    add_dataloader_idx=False,
                )

    on_test_epoch_end = on_validation_epoch_end

    # ---- optimisation ---------------------------------------------------------------------------------
    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            fused=None,  # Lightning refuses fused AdamW with gradient clipping under bf16-mixed
        )
        total = (
            self.trainer.max_steps
            if self.trainer.max_steps > 0
            else int(self.trainer.estimated_stepping_batches)
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, wsd_lambda(self.warmup_steps, total, self.stable_ratio, self.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["config"] = self.config
        if self._saving_mid_step:
            unstart_current_batch(checkpoint["loops"]["fit_loop"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A resume may change the optimizer settings (optim.*): the configured ones replace the saved ones (torch
        would restore the saved learning rate, betas, eps and weight decay); the schedule's multiplier stays. A
        checkpoint of another model type is refused with the model it is."""
        check_checkpoint_fits(checkpoint, self.state_dict(), self.config)
        for opt in checkpoint.get("optimizer_states", []):
            for group, decay in zip(opt["param_groups"], (self.weight_decay, 0.0), strict=False):
                scale = self.lr / group.get("initial_lr", self.lr)
                group.update(lr=group["lr"] * scale, initial_lr=self.lr, betas=self.betas, eps=self.eps)
                group["weight_decay"] = decay
        for sched in checkpoint.get("lr_schedulers", []):
            sched["base_lrs"] = [self.lr] * len(sched["base_lrs"])


def unstart_current_batch(fit_loop: dict) -> None:
    """A checkpoint saved before the optimizer step records its batch as started but not completed, which a resumed
    Lightning run counts as one extra batch (validation, checkpoints and logged steps shift by one). Mark the batch
    as never started: the resumed run redoes it and counts exactly like an uninterrupted run."""
    for progress in fit_loop["epoch_loop.batch_progress"].values():
        if isinstance(progress, dict):  # "total" and "current"
            done = progress["completed"]
            progress.update(ready=done, started=done, processed=done)


def exact_match(logits: Tensor, targets: Tensor, batch: dict) -> Tensor:
    """Per-sample exact match (B,): every argmax prediction at the sample's answer positions is right.

    Teacher-forced and greedy-decoded exact match agree: greedy decoding reproduces the answer (and its EOS)
    exactly when every teacher-forced argmax along it is right.
    """
    scored = scored_positions(batch["labels"])
    rows = scored.nonzero()[:, 0]
    is_answer = batch["answer_mask"][scored]
    wrong = (logits.argmax(-1) != targets) & is_answer
    B = batch["input_ids"].shape[0]
    n_wrong = torch.zeros(B, device=logits.device, dtype=torch.long).index_add_(0, rows, wrong.long())
    return (n_wrong == 0).float()
