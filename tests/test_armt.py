"""ARMT: the associative memory against its formulas (DPFP, delta rule, capacity, re-writing), ARMT against RMT and
against hand-built segments, constant-size state, and a recall task that only the associative memory can carry.

Padding, streaming (iter_logits = forward, stream mode with reset rows), generation and truncated BPTT (gradients stop
at depth k2) are tested for RMT, RMT-R and ARMT (both layouts, memory switched on) together in tests/test_rmt.py.
"""

import pytest
import torch
import torch.nn.functional as F

from models.armt import ARMT, build_armt
from models.associative import EPS, delta_write, dpfp, read
from models.rmt import RMT
from tests.test_rmt import V, lm_batch, recall_batch, tiny_backbone, tiny_gpt2
from tests.tiny_models import active_armt


def dpfp_by_hand(x: torch.Tensor, nu: int) -> torch.Tensor:
    """Schlag et al. 2021, Eq. 37: phi_{(j-1) 2d + a}(x) = r_a r_{(a + j) mod 2d}, r = [relu(x); relu(-x)]."""
    r = torch.cat([x.clamp(min=0), (-x).clamp(min=0)], -1)
    n = r.shape[-1]
    return torch.stack([r[..., a] * r[..., (a + j) % n] for j in range(1, nu + 1) for a in range(n)], -1)


def test_dpfp_is_the_products_of_neighbouring_relu_features():
    x = torch.randn(3, 5, 8)
    for nu in (1, 2, 3):
        assert dpfp(x, nu).shape == (3, 5, 2 * nu * 8)
        torch.testing.assert_close(dpfp(x, nu), dpfp_by_hand(x, nu))


def pair_keys(d: int, nu: int, gen: torch.Generator) -> torch.Tensor:
    """All 2 nu d keys (2 nu d, d) whose DPFP features are one-hot, in random order with random magnitudes: the key
    with r_a, r_{a+j} > 0 (two coordinates of chosen signs) lights feature (j, a) alone. No key set holds more
    orthogonal features: that is DPFP-nu's capacity, 2 nu d associations."""
    keys = []
    for j in range(1, nu + 1):
        for a in range(2 * d):
            key = torch.zeros(d)
            for idx in (a, (a + j) % (2 * d)):  # r index -> coordinate idx mod d, sign + below d, - above
                key[idx % d] = (1 if idx < d else -1) * (0.5 + torch.rand(1, generator=gen).item())
            keys.append(key)
    return torch.stack(keys)[torch.randperm(2 * nu * d, generator=gen)]


def unit_features(keys: torch.Tensor, nu: int) -> torch.Tensor:
    return F.normalize(dpfp(keys, nu), dim=-1)


def test_delta_rule_stores_and_retrieves_up_to_the_dpfp_capacity():
    """A fresh memory takes 2 nu d associations (a full memory: F = 2 nu d features), written m at a time as
    segments write their memory tokens, and gives each value back from its key."""
    d, nu, D, m = 4, 3, 16, 6
    gen = torch.Generator().manual_seed(0)
    keys = unit_features(pair_keys(d, nu, gen), nu)[None]  # (1, 24, 24): 24 keys, capacity 24
    values = torch.randn(1, 2 * nu * d, D, generator=gen)
    A, z = torch.zeros(1, 2 * nu * d, D), torch.zeros(1, 2 * nu * d)
    for a in range(0, keys.shape[1], m):
        A, z = delta_write(A, z, keys[:, a : a + m], values[:, a : a + m], torch.ones(1, m, 1))
    torch.testing.assert_close(read(A, z, keys), values / (1 + EPS))


def test_rewriting_a_key_replaces_its_value():
    """The delta rule stores v - v_bar (what the key held), and gamma = 0 keeps z from counting the key twice, so
    a re-written key reads its new value, not the mean of both; other keys are untouched. Also for a dense key."""
    d, nu, D = 4, 2, 8
    gen = torch.Generator().manual_seed(1)
    keys = unit_features(pair_keys(d, nu, gen)[:5], nu)[None]  # (1, 5, 16)
    old, new = torch.randn(1, 5, D, generator=gen), torch.randn(1, 1, D, generator=gen)
    A, z = delta_write(torch.zeros(1, 16, D), torch.zeros(1, 16), keys, old, torch.ones(1, 5, 1))
    A2, z2 = delta_write(A, z, keys[:, 2:3], new, torch.ones(1, 1, 1))
    torch.testing.assert_close(z2, z)
    expected = torch.cat([old[:, :2], new, old[:, 3:]], 1)
    torch.testing.assert_close(read(A2, z2, keys), expected, atol=1e-4, rtol=1e-4)
    dense = unit_features(torch.randn(1, 1, d, generator=gen), nu)
    A, z = delta_write(torch.zeros(1, 16, D), torch.zeros(1, 16), dense, old[:, :1], torch.ones(1, 1, 1))
    A, z = delta_write(A, z, dense, new, torch.ones(1, 1, 1))
    torch.testing.assert_close(read(A, z, dense), new, atol=1e-4, rtol=1e-4)


def test_with_a_zero_and_rmt_tokens_armt_is_rmt():
    """A new ARMT has W_V = 0, so A stays 0 and every read is 0: with RMT's tokens it computes RMT exactly
    (same backbone and memory), logits and gradients, padding and all."""
    torch.manual_seed(0)
    bb = tiny_backbone()
    armt, rmt = ARMT(bb, num_memory=2, segment_size=4, rmt_tokens=True), RMT(bb, num_memory=2, segment_size=4)
    rmt.memory = armt.memory
    ids = torch.randint(0, V, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    logits, grads = [], []
    for model in (armt, rmt):
        model.zero_grad()
        out = model(lm_batch(ids, mask))
        F.cross_entropy(out.logits, out.targets).backward()
        logits.append(out.logits)
        grads.append([p.grad for p in (*bb.parameters(), armt.memory)])
    torch.testing.assert_close(*logits)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    state = armt.initial_state(2)
    for a, b in armt.segment_bounds(11):
        _, state = armt.run_segment(state, ids[:, a:b], mask[:, a:b])
    assert not state.associative.A.any()


def hand_built_logits(model: ARMT, ids: torch.Tensor) -> torch.Tensor:
    """Segments [X_t; M] through the backbone, every layer reading and writing A, z by the formulas, token by token."""
    bb, m, nu = model.backbone, model.num_memory, 3
    n_layers, Fdim, D = len(bb.layers), model.n_features, bb.hidden_size
    A, z = [torch.zeros(Fdim, D) for _ in range(n_layers)], [torch.zeros(Fdim) for _ in range(n_layers)]
    phi = lambda x: F.normalize(dpfp_by_hand(x, nu), dim=-1)  # noqa: E731
    logits, outputs = [], []  # outputs: each layer's output at the write tokens, this segment

    def hook(layer, x):
        if layer > 0:
            outputs.append(x[0, -m:])
        if layer == n_layers:
            return x
        q = phi(x[0] @ model.layer_memories[layer].q_proj.weight.T)  # (T, F)
        return x + torch.stack([A[layer].T @ f / (z[layer] @ f + EPS) for f in q])[None]

    for a, b in model.segment_bounds(ids.shape[1]):
        outputs.clear()
        x = torch.cat([bb.embed(ids[:, a:b]), model.memory[None]], 1)
        logits.append(bb.head(bb(inputs_embeds=x, residual_hook=hook)[0, : b - a]))
        for layer, mem in enumerate(model.layer_memories):
            k = phi(outputs[layer] @ mem.k_proj.weight.T)
            v = outputs[layer] @ mem.v_proj.weight.T
            beta = torch.sigmoid(outputs[layer] @ mem.beta_proj.weight.T + mem.beta_proj.bias)
            stored = [A[layer].T @ k[i] / (z[layer] @ k[i] + EPS) for i in range(m)]
            gamma = [(1 - z[layer] @ k[i] / (k[i] @ k[i])).clamp(0, 1) for i in range(m)]
            A[layer] = A[layer] + sum(beta[i] * torch.outer(k[i], v[i] - stored[i]) for i in range(m))
            z[layer] = z[layer] + sum(gamma[i] * k[i] for i in range(m))
    return torch.cat(logits)


def test_segments_equal_hand_built_forwards():
    torch.manual_seed(0)
    model = active_armt(tiny_backbone(), num_memory=3, segment_size=5, d_mem=4, nu=3).eval()
    ids = torch.randint(0, V, (1, 14))  # segments of 4, 5, 5 tokens
    with torch.no_grad():
        expected = hand_built_logits(model, ids)
        torch.testing.assert_close(model(lm_batch(ids)).logits, expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(
            model.backbone.head(model.scored_hidden(lm_batch(ids), recurrent=False)), expected
        )


def test_state_has_a_fixed_size_and_restarted_rows_forget():
    """After any number of segments the state is m tokens (0 in the paper's layout) and A, z of every layer."""
    torch.manual_seed(0)
    model = build_armt(tiny_backbone(), num_memory=2, segment_size=4, d_mem=8, nu=2).eval()
    state = model.initial_state(2)
    for _ in range(5):
        _, state = model.run_segment(state, torch.randint(0, V, (2, 4)), None)
        assert state.memory.shape == (2, 0, 32)
        assert state.associative.A.shape == (2, 2, 32, 32) and state.associative.z.shape == (2, 2, 32)
    state = model.restart_rows(state, torch.tensor([True, False]))
    assert (
        not state.associative.A[0].any() and not state.associative.z[0].any() and state.associative.z[1].any()
    )


def test_refuses_hugging_face_backbones_and_bad_arguments():
    with pytest.raises(ValueError, match="backbone.weights="):
        ARMT(tiny_gpt2(), num_memory=2, segment_size=4)
    with pytest.raises(ValueError, match="residual-stream hook needs our Llama"):
        tiny_gpt2()(torch.zeros(1, 3, dtype=torch.long), residual_hook=lambda i, x: x)
    with pytest.raises(ValueError, match="num_memory must be >= 1"):
        ARMT(tiny_backbone(), num_memory=0, segment_size=4)
    with pytest.raises(ValueError, match="d_mem and nu"):
        ARMT(tiny_backbone(), num_memory=2, segment_size=4, nu=0)


@pytest.mark.parametrize("use_denom", [True, False])
def test_associative_memory_carries_a_fact_across_segments(use_denom):
    """The fact sits in segment 1, the question in segment 2; in the paper's layout nothing but A, z passes between
    segments, and ARMT learns the task (W_V starting at zero), with the normaliser and without it."""
    torch.manual_seed(0)
    n_values, L = 8, 6
    model = ARMT(
        tiny_backbone(vocab_size=2 * n_values + 1), num_memory=2, segment_size=L, d_mem=8, use_denom=use_denom
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # seed 0 passes 0.9 after ~150 steps and is at 1.0 from 200 on
        batch = recall_batch(32, L, n_values, gen)
        out = model(batch)
        loss = F.cross_entropy(out.logits, out.targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    batch = recall_batch(256, L, n_values, gen)
    with torch.no_grad():
        out = model.eval()(batch)
    assert (out.logits.argmax(-1) == out.targets).float().mean() > 0.9


def test_without_the_denominator_writes_are_the_delta_rule_applied_in_turn():
    """use_denom=False: the closed form equals writing each memory token after the other (A <- A + beta phi (v -
    A^T phi)^T), reads A^T phi(q), and a key re-written with beta = 1 reads its new value exactly however much it
    overlaps the others (all DPFP features are >= 0, so keys always overlap)."""
    gen = torch.Generator().manual_seed(2)
    B, m, d, nu, D = 2, 5, 4, 2, 6
    phi = unit_features(torch.randn(B, m, d, generator=gen), nu)
    v, beta = torch.randn(B, m, D, generator=gen), torch.rand(B, m, 1, generator=gen)
    A0, z0 = torch.randn(B, 2 * nu * d, D, generator=gen), torch.rand(B, 2 * nu * d, generator=gen)
    A, z = delta_write(A0, z0, phi, v, beta, use_denom=False)
    expected = A0
    for i in range(m):
        k = phi[:, i : i + 1]  # (B, 1, F)
        expected = expected + k.transpose(1, 2) @ (beta[:, i : i + 1] * (v[:, i : i + 1] - k @ expected))
    torch.testing.assert_close(A, expected)
    torch.testing.assert_close(z, z0)
    torch.testing.assert_close(read(A0, z0, phi, use_denom=False), phi @ A0)
    A, _ = delta_write(A0, z0, phi, v, torch.ones(B, m, 1), use_denom=False)
    torch.testing.assert_close(read(A, z0, phi[:, -1:], use_denom=False), v[:, -1:])


def test_without_the_denominator_the_memory_stays_bounded_where_the_normalised_one_grows():
    """300 segments each writing m = 8 near-identical keys (as a trained ARMT's write tokens tend to: the same
    learned tokens, one segment) with beta = 1 and values of norm 1: the normalised parallel write (ARMT's) adds up
    8 corrections of the same stored value and A grows by orders of magnitude; the delta rule applied in turn
    keeps every read within the written values' scale."""
    gen = torch.Generator().manual_seed(3)
    m, d, nu, D = 8, 8, 3, 16
    A = {True: torch.zeros(1, 2 * nu * d, D), False: torch.zeros(1, 2 * nu * d, D)}
    z = {True: torch.zeros(1, 2 * nu * d), False: torch.zeros(1, 2 * nu * d)}
    for _ in range(300):
        phi = unit_features(
            torch.randn(1, 1, d, generator=gen) + 0.1 * torch.randn(1, m, d, generator=gen), nu
        )
        v = F.normalize(torch.randn(1, m, D, generator=gen), dim=-1)
        for use_denom in (True, False):
            A[use_denom], z[use_denom] = delta_write(
                A[use_denom], z[use_denom], phi, v, torch.ones(1, m, 1), use_denom
            )
    q = unit_features(torch.randn(1, 64, d, generator=gen), nu)
    assert read(A[False], z[False], q, use_denom=False).norm(dim=-1).max() < 2
    assert A[True].norm() > 1000 * A[False].norm()
