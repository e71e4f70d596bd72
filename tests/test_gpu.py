"""The code paths that differ on CUDA, against CPU float32 references: our Llama's attention paths (SDPA causal /
bool mask / ALiBi float mask, grouped-query) in float32 and under bf16 autocast, RMT / RMT-R losses and gradients,
RMT-R streaming with its in-place memory bank, Llama-XL streaming, greedy generation, LongCE, and train.py /
evaluate.py end to end with the auto precision (bf16-mixed on CUDA). ARMT joins the RMT loss, device and LongCE
tests, and streams under bf16 autocast with its associative memory in float32.

Run on a CUDA machine with `pytest -m gpu`; without CUDA they skip. Every test takes its device from the `device`
fixture, so the same comparisons dry-run on a CPU (against the CPU itself) with
    MEMLM_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py
"""

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evaluate import evaluate
from losses.longce import LongCE
from models.builders import auto_precision
from models.kv_cache import XLKVCache
from models.llama import Llama, LlamaConfig
from models.rmt import RMT
from models.rmt_retrieval import RMTRetrieval
from tests.test_evaluate import compose_eval
from tests.test_faults import compose_train, tiny_overrides
from tests.test_llama_xl import xl_model
from tests.test_longce import recurrent_model
from tests.test_rmt import V, lm_batch, tiny_backbone
from tests.test_train_models import QA1, QUICK, TINY_BACKBONE
from tests.tiny_models import VOCAB, active_armt, tiny_llama_lm
from train import train

pytestmark = pytest.mark.gpu

FP32 = dict(atol=1e-4, rtol=1e-4)
BF16_LOGITS, BF16_GRADS = 2e-2, 5e-2  # relative (norm) error of bf16 autocast vs float32 (CPU: ~1e-2, ~2e-2)


def kind(device: str) -> str:
    """cuda or cpu."""
    return torch.device(device).type


@pytest.fixture
def device() -> str:
    """The device under test: cuda, or MEMLM_TEST_DEVICE (e.g. cpu, to dry-run these tests)."""
    name = os.environ.get("MEMLM_TEST_DEVICE", "cuda")
    if kind(name) == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return name


@pytest.fixture(autouse=True)
def no_tf32():
    """Full float32 matmuls (no TF32), so that CUDA float32 results match the CPU's to 1e-4."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def on(device: str, model: nn.Module) -> nn.Module:
    """A copy of `model` on `device` (the original stays the CPU reference)."""
    return copy.deepcopy(model).to(device)


def batch_on(device: str, batch: dict) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def grads(model: nn.Module) -> dict[str, Tensor]:
    """Gradients on the CPU, by parameter name (parameters without one left out)."""
    return {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def assert_relative_error(got: Tensor, expected: Tensor, tol: float, what: str = "") -> None:
    """||got - expected|| / ||expected|| < tol: the check for bf16 results against float32 ones."""
    err = ((got.float().cpu() - expected).norm() / expected.norm()).item()
    assert err < tol, f"{what} relative error {err:.3g} >= {tol}"


def trainer_on(device: str) -> list[str]:
    """train.py overrides that put the run on `device`."""
    return [f"trainer.accelerator={'gpu' if kind(device) == 'cuda' else 'cpu'}", "trainer.devices=1"]


# ---- our Llama: the three attention paths, MHA and GQA, float32 and bf16 autocast ------------------------------
# path: (alibi, left padding). No mask: SDPA's is_causal (flash on CUDA); padding: a bool mask; ALiBi: a float
# bias (-inf where masked) cast to the autocast dtype.
ATTENTION = {
    "causal": (False, False),
    "left_pad": (False, True),
    "alibi": (True, False),
    "alibi_left_pad": (True, True),
}


def llama_logits_and_grads(
    model: Llama, ids: Tensor, mask: Tensor | None, targets: Tensor, device: str, bf16: bool
):
    """Logits (B, T, V) on the CPU and gradients of the cross-entropy against `targets`, computed on `device`."""
    model = on(device, model)
    with torch.autocast(kind(device), torch.bfloat16, enabled=bf16):
        logits = model.logits(ids.to(device), attention_mask=None if mask is None else mask.to(device))
    F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten()).backward()
    return logits.float().cpu(), grads(model)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("path", list(ATTENTION))
def test_llama_matches_cpu_float32(device, path, n_kv_heads, bf16):
    alibi, padded = ATTENTION[path]
    torch.manual_seed(0)
    cfg = LlamaConfig(97, 64, 2, 4, n_kv_heads, 128, max_positions=128, alibi=alibi, init_std=0.1)
    model = Llama(cfg)
    ids, targets = torch.randint(0, 97, (3, 40)), torch.randint(0, 97, (3, 40))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :13], mask[2, :1] = 0, 0
    ref_logits, ref_grads = llama_logits_and_grads(model, ids, mask, targets, "cpu", bf16=False)
    logits, got_grads = llama_logits_and_grads(model, ids, mask, targets, device, bf16)
    assert got_grads.keys() == ref_grads.keys()
    if not bf16:
        torch.testing.assert_close(logits, ref_logits, **FP32)
        torch.testing.assert_close(got_grads, ref_grads, **FP32)
        return
    assert_relative_error(logits, ref_logits, BF16_LOGITS, "logits")
    for name, grad in got_grads.items():
        assert_relative_error(grad, ref_grads[name], BF16_GRADS, name)


# ---- RMT / RMT-R ------------------------------------------------------------------------------------------------
def rmt_loss_and_grads(model: RMT, batch: dict, device: str) -> tuple[Tensor, dict[str, Tensor]]:
    model = on(device, model)
    out = model(batch_on(device, batch))
    loss = F.cross_entropy(out.logits.float(), out.targets)
    loss.backward()
    return loss.cpu(), grads(model)


@pytest.mark.parametrize("padded", [False, True], ids=["no_pad", "left_pad"])
@pytest.mark.parametrize("k2,ckpt", [(-1, False), (1, False), (1, True)], ids=["bptt", "k2=1", "k2=1-ckpt"])
@pytest.mark.parametrize("cls", [RMT, RMTRetrieval, active_armt], ids=["rmt", "rmt_r", "armt"])
def test_rmt_loss_and_gradients_match_cpu(device, cls, k2, ckpt, padded):
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=4, k2=k2, checkpoint_segments=ckpt)
    ids = torch.randint(0, V, (3, 14))  # segments of 2, 4, 4, 4 tokens
    mask = None
    if padded:  # row 0: a whole segment of padding and part of another
        mask = torch.ones_like(ids)
        mask[0, :7], mask[1, :1] = 0, 0
    ref_loss, ref_grads = rmt_loss_and_grads(model, lm_batch(ids, mask), "cpu")
    loss, got_grads = rmt_loss_and_grads(model, lm_batch(ids, mask), device)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert got_grads.keys() == ref_grads.keys()
    torch.testing.assert_close(got_grads, ref_grads, **FP32)


def test_rmt_r_streaming_matches_cpu_and_keeps_its_bank_on_the_device(device):
    """40 segments without gradients: the bank grows in place (doubling) on the device, logits equal the CPU's."""
    torch.manual_seed(0)
    model = RMTRetrieval(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 40 * 4))
    expected = torch.cat(list(model.iter_logits(ids)), 1)
    model, ids = on(device, model), ids.to(device)
    torch.testing.assert_close(torch.cat(list(model.iter_logits(ids)), 1).cpu(), expected, **FP32)

    state, capacities = model.initial_state(2), set()
    with torch.no_grad():
        for a, b in model.segment_bounds(ids.shape[1]):
            _, state = model.run_segment(state, ids[:, a:b], None)
            capacities.add(state.bank.states_buffer.shape[1])
    bank = state.bank
    assert bank.size == 41 * 2 and len(capacities) >= 4  # M_0 .. M_40; the buffer doubled several times
    tensors = (state.memory, bank.states_buffer, bank.valid_buffer)
    assert all(t.device.type == kind(device) for t in tensors)


def test_memory_wrapped_around_a_backbone_already_on_the_device(device):
    """RMT / RMT-R / ARMT built around a backbone on the device: the memory is made there, the loss is finite."""
    torch.manual_seed(0)
    for cls in (RMT, RMTRetrieval, active_armt):
        model = cls(tiny_backbone().to(device), num_memory=2, segment_size=4)
        assert model.memory.device.type == kind(device)
        if cls is active_armt:
            assert model.initial_state(2).associative.A.device.type == kind(device)
        out = model(batch_on(device, lm_batch(torch.randint(0, V, (2, 10)))))
        assert torch.isfinite(F.cross_entropy(out.logits.float(), out.targets))


def test_armt_streams_in_bf16_autocast_with_a_float32_memory(device):
    """Under bf16 autocast the associative memory stays float32 (it accumulates over the whole stream), and 20
    segments of logits stay within bf16 tolerance of the CPU's float32."""
    torch.manual_seed(0)
    model = active_armt(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 20 * 4))
    expected = torch.cat(list(model.iter_logits(ids)), 1)
    model, ids = on(device, model), ids.to(device)
    with torch.no_grad(), torch.autocast(kind(device), torch.bfloat16):
        got = torch.cat(list(model.iter_logits(ids)), 1)
        _, state = model.run_segment(model.initial_state(2), ids[:, :4], None)
    assert state.associative.A.dtype == state.associative.z.dtype == torch.float32
    assert_relative_error(got, expected, BF16_LOGITS, "logits")


def test_cached_keys_without_a_padding_mask_match_cpu(device):
    """Segments through a KV cache with no attention_mask: the bottom-right causal mask is made on the device."""
    torch.manual_seed(0)
    model, ids = tiny_backbone().eval(), torch.randint(0, V, (2, 12))

    def run(dev: str) -> Tensor:
        backbone, cache, hidden = on(dev, model), XLKVCache(max_tokens=8), []
        for a in range(0, 12, 4):
            segment = ids[:, a : a + 4].to(dev)
            cache.begin(torch.ones_like(segment))
            hidden.append(backbone(input_ids=segment, kv_cache=cache))
        return torch.cat(hidden, 1).cpu()

    torch.testing.assert_close(run(device), run("cpu"), **FP32)


def test_a_cpu_run_on_a_cuda_machine_gets_cpu_precision():
    """trainer.accelerator=cpu / device=cpu on a CUDA machine: float32, not the GPU's bf16 autocast."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert auto_precision("auto") == auto_precision("gpu") == auto_precision("cuda:0") == "bf16-mixed"
    assert compose_train(["trainer.accelerator=cpu"]).trainer.precision == "32-true"
    assert compose_eval(["device=cpu"]).precision == "32-true"


# ---- Llama-XL and greedy generation ----------------------------------------------------------------------------
def test_llama_xl_streaming_matches_cpu(device):
    model = xl_model(8).eval()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))  # segments 8, 8, 8, 6
    expected = torch.cat(list(model.iter_logits(ids)), 1)
    got = torch.cat(list(on(device, model).iter_logits(ids.to(device))), 1)
    torch.testing.assert_close(got.cpu(), expected, **FP32)


def generation_model(name: str) -> nn.Module:
    """A tiny eval-mode model of a vocabulary of 97 whose segments / window the generation crosses."""
    if name == "llama_xl":
        return xl_model(4).eval()
    if name == "causal_lm":
        return tiny_llama_lm(vocab_size=97, window=8, init_std=0.3)
    torch.manual_seed(0)
    return RMTRetrieval(tiny_backbone(vocab_size=97), num_memory=2, segment_size=4).eval()


@pytest.mark.parametrize("name", ["llama_xl", "rmt_r", "causal_lm"])
def test_greedy_generation_matches_cpu(device, name):
    """Same tokens as on the CPU, also when EOS stops a row early (Llama-XL keeps its `done` on the CPU)."""
    model = generation_model(name)
    prompt = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    free = model.generate(prompt, max_new_tokens=12, eos_id=-1)
    stop = free[0][3]
    stopped = model.generate(prompt, max_new_tokens=12, eos_id=stop)
    moved, prompt = on(device, model), prompt.to(device)
    assert moved.generate(prompt, max_new_tokens=12, eos_id=-1) == free
    assert moved.generate(prompt, max_new_tokens=12, eos_id=stop) == stopped


# ---- LongCE ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["causal_lm", "rmt", "rmt_r", "armt", "llama_xl"])
def test_longce_loss_and_gradients_match_cpu(device, name):
    """The weights' no-grad short-context pass takes other code paths on CUDA (one-pass log-softmax)."""
    model = tiny_llama_lm(window=24, seed=3, init_std=0.3) if name == "causal_lm" else recurrent_model(name)
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[2, :9] = 0  # a left-padded row
    batch, loss_fn = lm_batch(ids, mask), LongCE(gamma=5.0, K=6, d=4)

    def loss_and_grads(device: str) -> tuple[Tensor, dict[str, Tensor]]:
        moved, b = on(device, model), batch_on(device, batch)
        loss = loss_fn(moved(b), moved, b)
        loss.backward()
        return loss.cpu(), grads(moved)

    (ref_loss, ref_grads), (loss, got_grads) = loss_and_grads("cpu"), loss_and_grads(device)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert got_grads.keys() == ref_grads.keys()
    torch.testing.assert_close(got_grads, ref_grads, **FP32)


# ---- train.py / evaluate.py end to end ---------------------------------------------------------------------------
def test_train_and_evaluate_on_the_device(device, tmp_path):
    """A tiny LM run with the auto precision writes a checkpoint of finite float32 CPU-loadable weights, whose
    perplexity evaluated on the device (auto precision) is the CPU float32 one."""
    train(compose_train(tiny_overrides(tmp_path, 6, 3, *trainer_on(device))))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 6
    for name, t in state["state_dict"].items():
        assert t.device.type == "cpu" and t.dtype == torch.float32 and bool(t.isfinite().all()), name

    args = [f"ckpt_path={ckpt}", "eval=[ppl]", "eval.ppl.max_len=64", "eval.ppl.max_docs=2", "logger=csv"]
    got = evaluate(compose_eval([*args, f"device={device}"]))["eval/ppl"]
    expected = evaluate(compose_eval([*args, "device=cpu", "precision=32-true"]))["eval/ppl"]
    assert math.isfinite(got) and got == pytest.approx(expected, rel=BF16_LOGITS)


def test_rmt_r_trains_on_babilong_and_draws_memory_maps_on_the_device(device, tmp_path):
    overrides = ["model=rmt_r", "loss=longce", *TINY_BACKBONE, *QA1, *QUICK]
    metrics = train(compose_train([*overrides, *trainer_on(device), f"run_dir={tmp_path}"]))
    assert math.isfinite(metrics["train/loss"]) and 0 <= metrics["val/qa1/acc@2seg"] <= 1
    assert [p.name for p in tmp_path.glob("memory_maps*")] == ["memory_maps.png"]  # one image, the newest
