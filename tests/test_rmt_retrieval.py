"""RMT-R: retrieval against its formula, the bank's growth, and the bank object itself.

Padding, streaming, truncated BPTT and generation are tested for RMT and RMT-R together in tests/test_rmt.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig
from models.memory import MemoryBank
from models.rmt_retrieval import RMTRetrieval, build_rmt_r

V = 61


def tiny_backbone() -> Llama:
    return Llama(LlamaConfig(vocab_size=V, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=64))


def retrieve_by_hand(model: RMTRetrieval, memory: torch.Tensor, past: list[torch.Tensor]) -> torch.Tensor:
    """R_t from the paper's formula with the module's weights: memory (B, m, D), past states [M_0 .. M_{t-1}]."""
    r = model.retrieval
    states = torch.cat(past, 1)  # (B, t*m, D)
    q = r.q_proj(F.layer_norm(memory, (memory.shape[-1],), r.norm_q.weight, r.norm_q.bias))
    kv_in = F.layer_norm(states, (states.shape[-1],), r.norm_kv.weight, r.norm_kv.bias)
    k, v = r.k_proj(kv_in), r.v_proj(kv_in)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1)
    out = memory + r.o_proj(att @ v)
    return out + r.mlp(F.layer_norm(out, (out.shape[-1],), r.norm_mlp.weight, r.norm_mlp.bias))


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_segments_equal_hand_built_forwards_with_retrieval(scale):
    """Each segment runs s [M_{t-1}; R_t; X_t; M_{t-1}] (s = memory_scale on the memory parts only), R_t
    retrieved from the unscaled [M_0 .. M_{t-1}] by the paper's formula; the gradients of every weight agree too."""
    torch.manual_seed(0)
    bb = tiny_backbone()
    m, L = 2, 4
    model = RMTRetrieval(bb, num_memory=m, segment_size=L, memory_scale=scale)
    ids = torch.randint(0, V, (2, 10))  # segments of 2, 4, 4 tokens
    memory = model.memory.expand(2, -1, -1)
    past, logits = [memory], []
    for a, b in [(0, 2), (2, 6), (6, 10)]:
        read = torch.cat([memory, retrieve_by_hand(model, memory, past)], 1)
        hidden = bb(inputs_embeds=torch.cat([scale * read, bb.embed(ids[:, a:b]), scale * memory], 1))
        logits.append(bb.head(hidden[:, 2 * m : 2 * m + b - a]))
        memory = hidden[:, 2 * m + b - a :]
        past.append(memory)
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    out = model({"input_ids": ids, "labels": labels})
    expected = torch.cat(logits, 1).flatten(0, 1)
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(expected)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad((out.logits * weights).sum(), params, allow_unused=True)
    ref = torch.autograd.grad((expected * weights).sum(), params)
    for p, g, r in zip(params, got, ref, strict=True):  # b_K: no gradient (a shift per query)
        torch.testing.assert_close(torch.zeros_like(p) if g is None else g, r, atol=1e-5, rtol=1e-4)


def test_retrieving_latest_equals_hand_built_forwards_that_retrieve_from_the_last_state_alone():
    """The ablation of evaluate.py's eval.babilong.memory=latest: each segment retrieves from [M_{t-1}] alone; a
    row that ran out of tokens keeps its state; outside the context the bank holds every state again."""
    torch.manual_seed(0)
    bb = tiny_backbone()
    m = 2
    model = RMTRetrieval(bb, num_memory=m, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 10))  # segments of 2, 4, 4 tokens; row 1 is padding after its 6th token
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 6:] = False
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask, ids, -100)}
    with torch.no_grad():
        full = model(batch).logits
        with model.retrieving_latest():
            latest = model(batch).logits
        assert not model.latest_only
        torch.testing.assert_close(model(batch).logits, full)
        memory = model.memory.expand(2, -1, -1)
        logits = []
        for a, b in [(0, 2), (2, 6), (6, 10)]:
            read = torch.cat([memory, retrieve_by_hand(model, memory, [memory])], 1)
            hidden = bb(inputs_embeds=torch.cat([read, bb.embed(ids[:, a:b]), memory], 1))
            logits.append(bb.head(hidden[:, 2 * m : 2 * m + b - a]))  # row 1's last segment: not scored
            memory = torch.where(mask[:, a:b].any(1)[:, None, None], hidden[:, 2 * m + b - a :], memory)
    torch.testing.assert_close(latest, torch.cat(logits, 1)[mask], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(latest, full)


def test_bank_and_read_memory_grow_as_specified():
    """Before segment t the bank holds t states (t*m entries), retrieval attends over all of them, and the
    backbone sees 2m read + L tokens + m write positions."""
    torch.manual_seed(0)
    B, m, L, D = 3, 4, 5, 32
    model = build_rmt_r(tiny_backbone(), num_memory=m, segment_size=L)
    seen = []
    model.backbone.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["inputs_embeds"].shape), with_kwargs=True
    )
    state = model.initial_state(B)
    ids = torch.randint(0, V, (B, L))
    for t in range(1, 5):
        assert state.bank.states.shape == (B, t * m, D) and state.bank.valid.shape == (B, t * m)
        assert model.read_memory(state).shape == (B, 2 * m, D)
        _, state = model.run_segment(state, ids, None)
        assert seen[-1] == (B, 2 * m + L + m, D)


def test_memory_bank_in_place_append_equals_autograd_append():
    """Without gradients the bank writes into a doubling buffer; its contents equal the concatenating path."""
    torch.manual_seed(0)
    entries = [(torch.randn(2, 3, 8), torch.rand(2, 3) > 0.3) for _ in range(6)]
    grad_bank = MemoryBank.start(*entries[0])
    for e in entries[1:]:
        grad_bank = grad_bank.append(*e)
    with torch.no_grad():
        bank = MemoryBank.start(*entries[0])
        for e in entries[1:]:
            bank = bank.append(*e)
    assert bank.size == 18 and bank.states_buffer.shape[1] >= 18
    for name in ("states", "valid"):
        torch.testing.assert_close(getattr(bank, name), getattr(grad_bank, name))


def test_stream_restart_drops_states_no_row_can_use():
    """After every row restarted, the bank holds only the new streams' states."""
    torch.manual_seed(0)
    m, L = 2, 4
    model = RMTRetrieval(tiny_backbone(), num_memory=m, segment_size=L).eval()
    ids = torch.randint(0, V, (2, 3 * L))
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    model({"input_ids": ids, "labels": labels, "reset": torch.tensor([True, True])})
    assert model._carried[False].bank.size == 4 * m  # M_0 and three segments
    model({"input_ids": ids[:, :L], "labels": labels[:, :L], "reset": torch.tensor([True, False])})
    assert model._carried[False].bank.size == 6 * m  # row 1 still uses the old states
    model({"input_ids": ids[:, :L], "labels": labels[:, :L], "reset": torch.tensor([False, True])})
    assert model._carried[False].bank.valid.any(0).all()
    assert model._carried[False].bank.size == 4 * m  # row 0: M_0 + 2 segments; row 1: M_0 + 1 segment


def test_retrieval_attends_over_the_valid_bank_entries_only():
    """Each row retrieves by the formula over its valid past states alone (invalid entries hold garbage)."""
    torch.manual_seed(0)
    model = RMTRetrieval(tiny_backbone(), num_memory=3, segment_size=4)
    memory, states = torch.randn(2, 3, 32), torch.randn(2, 7, 32)
    valid = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    bank = MemoryBank.start(model.retrieval.bank_entry(states), valid)
    got = model.retrieval(memory, bank)
    for b in range(2):
        expected = retrieve_by_hand(model, memory[b : b + 1], [states[b : b + 1, valid[b]]])
        torch.testing.assert_close(got[b : b + 1], expected)
