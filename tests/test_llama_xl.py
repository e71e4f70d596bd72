"""Llama-XL and its KV cache: exactness against full forwards with the XL mask, streams across batches, weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from models.backbone import build_llama
from models.kv_cache import XLKVCache
from models.llama import Llama, LlamaConfig
from models.llama_xl import LlamaXL, build_llama_xl
from models.lm import CausalLM

V = 97
TOL = dict(atol=1e-5, rtol=1e-5)


def tiny_cfg(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=V,
        hidden_size=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_size=128,
        max_positions=128,
        key_norm=True,
        attn_scale=1.0,
        init_std=0.1,
    )
    return LlamaConfig(**{**base, **kw})


def xl_model(segment_size: int = 8, backbone: dict | None = None, **kw) -> LlamaXL:
    torch.manual_seed(0)
    if "cache_tokens" not in kw:
        kw.setdefault("cache_segments", 1)
    return LlamaXL(Llama(tiny_cfg(**(backbone or {}))), segment_size, **kw)


def batch_logits(model: LlamaXL, input_ids: torch.Tensor, **extra) -> torch.Tensor:
    """Logits (B, T, V) of a training forward that scores every position."""
    out = model({"input_ids": input_ids, "labels": torch.zeros_like(input_ids), **extra})
    return out.logits.view(*input_ids.shape, -1)


def xl_mask(
    T: int, S: int, cache_tokens: int | None = None, cache_segments: int | None = None
) -> torch.Tensor:
    """(1, 1, T, T) mask of a full forward that sees what Llama-XL sees: a query of the segment starting at a
    attends causally within its segment and to the cached tokens before a (the last N, or the last m segments)."""
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    start = q // S * S
    cached = start.clamp(max=cache_tokens if cache_tokens is not None else cache_segments * S)
    return ((k <= q) & (k >= start - cached))[None, None]


# ---- exactness ---------------------------------------------------------------------------------------------
def test_empty_cache_equals_llama_with_normalised_keys():
    model = xl_model(segment_size=16).eval()
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        reference = model.backbone.logits(ids)  # no cache: plain causal forward, keys L2-normalised
        torch.testing.assert_close(batch_logits(model, ids), reference, **TOL)
        torch.testing.assert_close(next(model.iter_logits(ids)), reference, **TOL)


@pytest.mark.parametrize("cache", [{"cache_segments": 1}, {"cache_segments": 2}, {"cache_tokens": 5}])
@pytest.mark.parametrize("how", ["forward", "iter_logits"])
@pytest.mark.parametrize("keys", ["normalised", "as trained"])
def test_segments_equal_full_forward_with_xl_mask(cache, how, keys):
    """Segment by segment with the cache = one forward over the whole text with the XL mask and absolute
    positions: the hidden states of the cached segment at every layer are the ones it got with its own cache, and
    RoPE only sees position differences, which the cache's positions 0..Tk-1 reproduce. The same holds for a
    pretrained Llama run with its keys as trained (key_norm=False, the usual 1/sqrt(head_dim) scale)."""
    S, T = 8, 35  # 4 full segments and a short one
    backbone = {} if keys == "normalised" else {"key_norm": False, "attn_scale": None}
    model = xl_model(S, backbone, **cache).eval()
    ids = torch.randint(0, V, (2, T))
    with torch.no_grad():
        got = batch_logits(model, ids) if how == "forward" else torch.cat(list(model.iter_logits(ids)), dim=1)
        want = model.backbone.logits(ids, attention_mask=xl_mask(T, S, **cache))
        plain = model.backbone.logits(ids)
    torch.testing.assert_close(got, want, **TOL)
    assert (
        got[:, 2 * S :] - plain[:, 2 * S :]
    ).abs().max() > 1e-2  # the check can tell XL from full attention


def test_stream_continues_across_batches_and_restarts_on_reset():
    S = 8
    model = xl_model(S, cache_segments=1).train()  # no dropout: train mode is deterministic
    stream = torch.randint(0, V, (2, 32))
    with torch.no_grad():
        batch_logits(model, stream[:, :16], reset=torch.tensor([True, True]))
        model.eval()
        batch_logits(model, torch.randint(0, V, (3, 16)))  # validation in between has its own cache
        model.train()
        got = batch_logits(model, stream[:, 16:], reset=torch.tensor([False, True]))
        want = model.backbone.logits(stream, attention_mask=xl_mask(32, S, cache_segments=1))[0, 16:]
        fresh = model.backbone.logits(stream[1:, 16:], attention_mask=xl_mask(16, S, cache_segments=1))[0]
    torch.testing.assert_close(got[0], want, **TOL)  # row 0 continues its stream
    torch.testing.assert_close(got[1], fresh, **TOL)  # row 1 restarted: its cached tokens are masked


def test_batch_without_reset_starts_fresh_streams():
    model = xl_model(8).train()
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        batch_logits(model, torch.randint(0, V, (2, 16)))
        got = batch_logits(model, ids)
        want = model.backbone.logits(ids, attention_mask=xl_mask(16, 8, cache_segments=1))
    torch.testing.assert_close(got, want, **TOL)


def test_padded_keys_are_never_attended_also_from_the_cache():
    """Left padding inside the first segment: the second segment's queries must ignore it in the cache."""
    model = xl_model(8).eval()
    ids = torch.randint(0, V, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    noisy = ids.clone()
    noisy[0, :5] = torch.randint(0, V, (5,))
    with torch.no_grad():
        a = batch_logits(model, ids, attention_mask=mask)
        b = batch_logits(model, noisy, attention_mask=mask)
        unmasked = batch_logits(model, noisy)
    torch.testing.assert_close(a[:, 5:], b[:, 5:], **TOL)
    assert (unmasked[0, 8:] - a[0, 8:]).abs().max() > 1e-2  # the padded tokens would matter if attended


def test_batch_size_change_mid_stream_is_explained():
    model = xl_model(8)
    batch_logits(model, torch.randint(0, V, (2, 8)), reset=torch.tensor([True, True]))
    with pytest.raises(ValueError, match="not every row is reset"):
        batch_logits(model, torch.randint(0, V, (3, 8)), reset=torch.tensor([False, True, True]))


def test_generate_is_greedy_over_iter_logits():
    model = xl_model(4).eval()
    prompt = torch.randint(0, V, (2, 6))
    gen = model.generate(prompt, max_new_tokens=9, eos_id=-1)
    full = torch.cat([prompt, torch.tensor(gen)], dim=1)  # (2, 15): crosses two segment boundaries
    logits = torch.cat(list(model.iter_logits(full)), dim=1)
    assert logits[:, 5:-1].argmax(-1).tolist() == gen
    stop = gen[0][2]
    assert model.generate(prompt, max_new_tokens=9, eos_id=stop)[0] == gen[0][: gen[0].index(stop) + 1]


@pytest.mark.parametrize("detach", [True, False])
def test_detach_cache_controls_gradient_into_the_previous_segment(detach):
    model = xl_model(8, detach_cache=detach)
    first, second = torch.randint(0, 40, (1, 8)), torch.randint(50, V, (1, 8))  # disjoint vocabularies
    labels = torch.cat([torch.full((1, 8), -100), torch.randint(0, V, (1, 8))], dim=1)  # score segment 2 only
    for reset in (True, False):  # the second batch continues the stream: its graph must not reach the first's
        model.zero_grad()
        out = model(
            {"input_ids": torch.cat([first, second], 1), "labels": labels, "reset": torch.tensor([reset])}
        )
        F.cross_entropy(out.logits, out.targets).backward()
        grad_first = model.backbone.embed_tokens.weight.grad[first[0]].abs().sum()
        assert (grad_first == 0) if detach else (grad_first > 0)


# ---- the cache on its own ----------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [{"max_tokens": 5}, {"max_segments": 2}])
def test_cache_returns_cache_then_new_and_keeps_its_window(limit):
    cache = XLKVCache(**limit)
    history: list[torch.Tensor] = []  # segments seen so far
    for T in (3, 4, 2, 6):
        k = torch.randn(2, 1, T, 4)
        if "max_tokens" in limit:
            kept = torch.cat([torch.zeros(2, 1, 0, 4), *history], dim=2)[:, :, -limit["max_tokens"] :]
        else:
            kept = torch.cat([torch.zeros(2, 1, 0, 4), *history[-limit["max_segments"] :]], dim=2)
        key_mask = cache.begin(torch.ones(2, T))
        k_hat, v_hat = cache.update(0, k, k + 1)
        torch.testing.assert_close(k_hat, torch.cat([kept, k], dim=2))
        torch.testing.assert_close(v_hat, torch.cat([kept + 1, k + 1], dim=2))
        assert key_mask.shape == (2, kept.shape[2] + T) and key_mask.all()
        history.append(k)


def test_cache_reset_zeroes_and_masks_restarted_rows():
    cache = XLKVCache(max_segments=1)
    cache.begin(torch.ones(2, 3))
    k = torch.randn(2, 1, 3, 4)
    cache.update(0, k, k)
    cache.reset(torch.tensor([True, False]))
    assert cache.keys[0][0].abs().sum() == 0 and torch.equal(cache.keys[0][1], k[1])
    assert cache.begin(torch.ones(2, 2)).tolist() == [[False] * 3 + [True] * 2, [True] * 5]
    cache.reset(torch.tensor([True, True]))
    assert cache.length == 0 and not cache.keys


def test_cache_detach_and_fork():
    k = torch.randn(1, 1, 3, 4, requires_grad=True)
    kept = XLKVCache(max_tokens=8, detach=False)
    kept.begin(torch.ones(1, 3))
    kept.update(0, k * 2, k)
    assert kept.keys[0].requires_grad
    kept.detach_()
    assert not kept.keys[0].requires_grad
    cut = XLKVCache(max_tokens=8)
    cut.begin(torch.ones(1, 3))
    cut.update(0, k * 2, k)
    assert not cut.keys[0].requires_grad
    fork = cut.fork()
    fork.begin(torch.ones(1, 2))
    fork.update(0, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert fork.length == 5 and cut.length == 3 and cut.keys[0].shape[2] == 3


def test_cache_misuse_is_explained():
    with pytest.raises(ValueError, match="exactly one"):
        XLKVCache()
    with pytest.raises(ValueError, match="exactly one"):
        XLKVCache(max_tokens=4, max_segments=1)
    cache = XLKVCache(max_segments=1)
    k = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="begin"):
        cache.update(0, k, k)
    cache.begin(torch.ones(1, 3))
    cache.update(0, k, k)
    with pytest.raises(RuntimeError, match="once per layer"):
        cache.update(0, k, k)
    with pytest.raises(ValueError, match="clear"):
        cache.begin(torch.ones(2, 3))


# ---- weights and construction ------------------------------------------------------------------------------
def test_baseline_checkpoint_loads_unchanged():
    torch.manual_seed(0)
    baseline = CausalLM(Llama(tiny_cfg(key_norm=False, attn_scale=None)))
    xl = LlamaXL(Llama(tiny_cfg()), 8, cache_segments=1)
    assert xl.state_dict().keys() == baseline.state_dict().keys()  # no cache or extra parameters
    xl.load_state_dict(baseline.state_dict())
    for name, t in baseline.state_dict().items():
        assert torch.equal(xl.state_dict()[name], t), name


def test_hf_llama_weights_load_unchanged(tmp_path):
    torch.manual_seed(1)
    cfg = tiny_cfg()
    hf = LlamaForCausalLM(Llama(cfg).hf_config())  # the same shape, its own random weights
    hf.save_pretrained(tmp_path)
    backbone = build_llama(**dataclasses.asdict(cfg), weights=str(tmp_path))
    xl = build_llama_xl(backbone, segment_size=16, cache_tokens=64)
    ours = xl.backbone.to_hf_state_dict()
    assert ours.keys() == {k for k in hf.state_dict() if "rotary_emb" not in k}
    for name, t in ours.items():
        assert torch.equal(t, hf.state_dict()[name]), name
    assert xl.cache_tokens == 64 and xl.cache_segments is None


def test_construction_errors_name_the_fix():
    with pytest.raises(ValueError, match="max_positions"):
        LlamaXL(Llama(tiny_cfg()), 100, cache_segments=1)
    with pytest.raises(ValueError, match="exactly one"):
        LlamaXL(Llama(tiny_cfg()), 8)
