"""Our Llama against Hugging Face LlamaForCausalLM with the same weights, and the backbone's interface."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from models.config_errors import ConfigError
from models.llama import Llama, LlamaConfig, apply_rope, rope_cos_sin, stick_breaking_weights


def tiny_cfg(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=97, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=128, max_positions=128
    )
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_hf_llama(tie):
    torch.manual_seed(0)
    ours = Llama(tiny_cfg(tie_embeddings=tie)).eval()
    hf = LlamaForCausalLM(ours.hf_config()).eval()
    hf.load_state_dict(ours.to_hf_state_dict(), strict=not tie)
    ids = torch.randint(0, 97, (3, 40))
    torch.testing.assert_close(ours.logits(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_from_hf_loads_pretrained_weights():
    torch.manual_seed(1)
    hf = LlamaForCausalLM(
        HFLlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=500.0,
            tie_word_embeddings=False,
        )
    ).eval()
    ours = Llama.from_hf(hf).eval()
    assert ours.cfg.n_kv_heads == 1 and ours.cfg.rope_theta == 500.0
    ids = torch.randint(0, 50, (2, 17))
    torch.testing.assert_close(ours.logits(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_left_padding_matches_unpadded():
    torch.manual_seed(0)
    model = Llama(tiny_cfg()).eval()
    ids = torch.randint(0, 97, (1, 12))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    torch.testing.assert_close(
        model.logits(padded, attention_mask=mask)[:, 5:], model.logits(ids), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("free", [None, [0, 1, 8]])
def test_alibi_attention_equals_a_hand_written_softmax_with_the_linear_bias(free):
    """free: tokens outside the bias (an RMT's memory), at distance 0 as queries and as keys."""
    torch.manual_seed(0)
    cfg = tiny_cfg(alibi=True)
    model = Llama(cfg).eval()
    attn, T = model.layers[0].self_attn, 9
    x = torch.randn(2, T, cfg.hidden_size)
    positions = torch.arange(T).expand(2, -1)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    q = apply_rope(attn.q_proj(x).view(2, T, cfg.n_heads, -1).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(2, T, cfg.n_kv_heads, -1).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(2, T, cfg.n_kv_heads, -1).transpose(1, 2)
    k, v = (t.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=1) for t in (k, v))
    slopes = torch.tensor([2 ** (-8 * h / cfg.n_heads) for h in range(1, cfg.n_heads + 1)])
    i = torch.arange(T)
    distance = (i[:, None] - i[None, :]).float()
    if free is not None:
        distance[free, :], distance[:, free] = 0, 0
    bias = -slopes[:, None, None] * distance  # (H, T, T)
    scores = (q @ k.transpose(-1, -2) / cfg.head_dim**0.5 + bias).masked_fill(
        i[None, :] > i[:, None], -torch.inf
    )
    expected = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, -1))
    seen = {}  # the model builds rotary tables and bias once per forward and hands every layer their builders
    attn.register_forward_pre_hook(lambda module, args: seen.update(rope_for=args[1], mask_for=args[2]))
    alibi_free = None if free is None else torch.isin(i, torch.tensor(free))
    model(torch.randint(0, 97, (2, T)), alibi_free=alibi_free)
    torch.testing.assert_close(attn(x, seen["rope_for"], seen["mask_for"], None, 0), expected)
    if free is not None:
        with pytest.raises(ConfigError, match="needs backbone.alibi=true"):
            Llama(tiny_cfg())(torch.randint(0, 97, (2, T)), alibi_free=alibi_free)


def test_unpadded_rows_share_one_alibi_bias():
    """Without padding the bias is built once, (1, H, T, T), not per row (the cost of a batch of 8-32 rows at eval),
    and the rows come out as with every row's positions given."""
    torch.manual_seed(0)
    model = Llama(tiny_cfg(alibi=True)).eval()
    ids, T = torch.randint(0, 97, (3, 11)), 11
    seen = {}
    model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: seen.update(mask=args[2](T)))
    shared = model(ids)
    assert seen["mask"].shape == (1, model.cfg.n_heads, T, T)
    per_row = model(ids, position_ids=torch.arange(T).repeat(3, 1))
    assert seen["mask"].shape == (3, model.cfg.n_heads, T, T)
    torch.testing.assert_close(shared, per_row, atol=0, rtol=0)


def test_alibi_keeps_left_padding_invariance_and_refuses_hf_export():
    torch.manual_seed(0)
    model = Llama(tiny_cfg(alibi=True)).eval()
    ids = torch.randint(0, 97, (1, 12))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    torch.testing.assert_close(
        model.logits(padded, attention_mask=mask)[:, 5:], model.logits(ids), atol=1e-5, rtol=1e-5
    )
    plain = Llama(tiny_cfg()).eval()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain.logits(ids), model.logits(ids))  # the bias changes the model
    with pytest.raises(ValueError, match="no Hugging Face Llama equivalent"):
        model.hf_config()


def test_stick_breaking_heads_equal_a_hand_written_stick_beside_alibi_heads():
    """The first two heads break each query's stick over its allowed keys from the nearest back: key j gets
    sigmoid(z_ij + bias_h) of what the keys after it left (Tan et al. 2024), no positions; the other two are ALiBi
    softmax heads with RoPE, their slopes spread over those two (1/16, 1/256). A left-padded row's padding takes
    nothing."""
    torch.manual_seed(0)
    cfg = tiny_cfg(stick_breaking_heads=2, alibi=True)
    model = Llama(cfg).eval()
    attn, B, T, S = model.layers[0].self_attn, 2, 9, 2
    keep = torch.ones(B, T, dtype=torch.long)
    keep[1, :3] = 0  # row 1 left-padded
    x = torch.randn(B, T, cfg.hidden_size)
    q = attn.q_proj(x).view(B, T, cfg.n_heads, -1).transpose(1, 2).double()
    k = attn.k_proj(x).view(B, T, cfg.n_kv_heads, -1).transpose(1, 2).double()
    v = attn.v_proj(x).view(B, T, cfg.n_kv_heads, -1).transpose(1, 2).double()
    k, v = (t.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=1) for t in (k, v))
    attn.stick_bias.data = torch.tensor([-1.0, 0.5])  # learned, one per stick-breaking head
    p = torch.sigmoid(
        q[:, :S] @ k[:, :S].transpose(-1, -2) / cfg.head_dim**0.5 + attn.stick_bias.double()[:, None, None]
    )
    positions = (keep.cumsum(-1) - 1).clamp(min=0)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float64)
    rq, rk = apply_rope(q[:, S:], cos, sin), apply_rope(k[:, S:], cos, sin)
    slopes = torch.tensor([1 / 16, 1 / 256], dtype=torch.float64)
    bias = -slopes[None, :, None, None] * (positions[:, None, :, None] - positions[:, None, None, :]).clamp(
        min=0
    )
    scores = rq @ rk.transpose(-1, -2) / cfg.head_dim**0.5 + bias  # (B, 2, T, T)
    weights = torch.zeros(B, cfg.n_heads, T, T, dtype=torch.float64)
    for b in range(B):
        for i in range(T):
            allowed = [j for j in range(i + 1) if keep[b, j] or j == i]
            stick = torch.ones(S, dtype=torch.float64)
            for j in reversed(allowed):
                weights[b, :S, i, j] = stick * p[b, :, i, j]
                stick = stick * (1 - p[b, :, i, j])
            weights[b, S:, i, allowed] = scores[b, :, i, allowed].softmax(-1)
    expected = attn.o_proj((weights @ v).float().transpose(1, 2).reshape(B, T, -1))
    seen = {}
    attn.register_forward_pre_hook(lambda module, args: seen.update(rope_for=args[1], mask_for=args[2]))
    model(torch.randint(0, 97, (B, T)), attention_mask=keep)
    torch.testing.assert_close(attn(x, seen["rope_for"], seen["mask_for"], None, 0), expected)


def test_stick_breaking_picks_the_latest_match_at_any_distance():
    """Two keys scoring alike: the later one takes almost all the weight however far back both lie, where softmax
    with ALiBi's gentlest slope (1/256) splits it nearly evenly."""
    T = 400
    for first, latest in [(0, 8), (250, 258), (380, 388)]:
        z = torch.full((1, 1, T, T), -12.0)
        z[..., first] = z[..., latest] = 8.0
        w = stick_breaking_weights(z, torch.ones(T, T, dtype=torch.bool).tril())[0, 0, -1]
        assert w[latest] > 0.99 and w[first] < 0.01
        alibi = (z[0, 0, -1] - (T - 1 - torch.arange(T)) / 256).softmax(-1)
        assert alibi[first] > 0.45


def test_stick_breaking_heads_are_checked_and_refuse_hf_export():
    with pytest.raises(ConfigError, match="stick_breaking_heads must be between 0 and n_heads"):
        tiny_cfg(stick_breaking_heads=5)
    with pytest.raises(ConfigError, match="leaves none: set alibi=false"):
        tiny_cfg(stick_breaking_heads=4, alibi=True)
    with pytest.raises(ValueError, match="no Hugging Face Llama equivalent"):
        Llama(tiny_cfg(stick_breaking_heads=4)).hf_config()


def test_inputs_embeds_equal_input_ids():
    model = Llama(tiny_cfg()).eval()
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(model(inputs_embeds=model.embed(ids)), model(ids))


def test_residual_hook_sees_every_layer_boundary():
    """The hook gets the stream entering each layer and, last, the last layer's output (before the final norm);
    what it returns is what the layer gets: adding d before layer 0 is the same as adding d to the embeddings."""
    torch.manual_seed(0)
    model = Llama(tiny_cfg()).eval()
    ids = torch.randint(0, 97, (2, 9))
    seen = []
    out = model(ids, residual_hook=lambda i, x: seen.append((i, x)) or x)
    assert [i for i, _ in seen] == [0, 1, 2]
    torch.testing.assert_close(seen[0][1], model.embed(ids))
    torch.testing.assert_close(out, model(ids))
    torch.testing.assert_close(model.norm(seen[-1][1]), out)
    d = torch.randn(64)
    shifted = model(ids, residual_hook=lambda i, x: x + d if i == 0 else x)
    torch.testing.assert_close(shifted, model(inputs_embeds=model.embed(ids) + d))


def test_init_std_and_embed_init_std_draw_in_the_same_order():
    """`embed_init_std` changes only the embeddings' scale: the same seed draws the same normals, so every other
    weight, and the embeddings divided by their std, are the default init's."""
    torch.manual_seed(0)
    base = Llama(tiny_cfg(n_layers=1, hidden_size=512, vocab_size=4000))
    torch.manual_seed(0)
    wide = Llama(tiny_cfg(n_layers=1, hidden_size=512, vocab_size=4000, embed_init_std=1.0))
    torch.testing.assert_close(wide.embed_tokens.weight * 0.02, base.embed_tokens.weight)
    assert abs(wide.embed_tokens.weight.std().item() - 1.0) < 0.01
    for (name, a), (_, b) in zip(base.named_parameters(), wide.named_parameters(), strict=True):
        if name != "embed_tokens.weight":
            assert torch.equal(a, b), name


def test_bad_config_is_explained():
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        tiny_cfg(n_kv_heads=3)
