"""RMT (and the segment machinery RMT-R and ARMT share): exactness against hand-built computations, padding,
truncated BPTT, streaming, and a recall task that needs the memory."""

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from callbacks.memory_maps import (
    attention_maps,
    attention_probs,
    fact_segments,
    memory_figure,
    memory_panels,
    memory_states,
)
from models.armt import ARMT
from models.backbone import HFBackbone
from models.config_errors import ConfigError
from models.llama import Llama, LlamaConfig
from models.rmt import RMT, build_rmt
from models.rmt_retrieval import RMTRetrieval
from tests.figures import assert_texts_inside
from tests.tiny_models import active_armt

V = 61
MODELS = [
    pytest.param(RMT, id="rmt"),
    pytest.param(RMTRetrieval, id="rmt_r"),
    pytest.param(active_armt, id="armt"),  # the paper's layout: [X_t; M], memory only in A, z
    pytest.param(partial(active_armt, rmt_tokens=True), id="armt_rmt_tokens"),
    pytest.param(partial(active_armt, use_denom=False), id="armt_no_denom"),  # the delta rule applied in turn
]


def tiny_backbone(
    vocab_size: int = V, hidden: int = 32, layers: int = 2, alibi: bool = False, stick_breaking_heads: int = 0
) -> Llama:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        ffn_size=2 * hidden,
        max_positions=256,
        alibi=alibi,
        stick_breaking_heads=stick_breaking_heads,
    )
    return Llama(cfg)


def lm_batch(ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """Every real position predicts the next token (the last one predicts itself, to score all positions)."""
    labels = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
    if mask is not None:
        labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "labels": labels} | ({} if mask is None else {"attention_mask": mask})


def test_zero_memory_one_segment_equals_backbone():
    torch.manual_seed(0)
    bb = tiny_backbone().eval()
    model = RMT(bb, num_memory=0, segment_size=16).eval()
    ids = torch.randint(0, V, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = model(lm_batch(ids, mask))
    expected = bb.logits(ids, attention_mask=mask)[mask.bool()]
    torch.testing.assert_close(out.logits, expected)


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_segments_equal_hand_built_forwards(scale):
    """[s M; X_t; s M] per segment, split from the right, new memory = last hidden states at the write positions
    (s = memory_scale: the memory is fed scaled, and carried as the backbone wrote it)."""
    torch.manual_seed(0)
    bb = tiny_backbone().eval()
    m, L = 3, 5
    model = RMT(bb, num_memory=m, segment_size=L, memory_scale=scale).eval()
    ids = torch.randint(0, V, (2, 13))  # segments of 3, 5, 5 tokens
    memory, logits = model.memory.expand(2, -1, -1), []
    for a, b in [(0, 3), (3, 8), (8, 13)]:
        hidden = bb(inputs_embeds=torch.cat([scale * memory, bb.embed(ids[:, a:b]), scale * memory], 1))
        logits.append(bb.head(hidden[:, m : m + b - a]))
        memory = hidden[:, m + b - a :]
    out = model(lm_batch(ids))
    torch.testing.assert_close(out.logits, torch.cat(logits, 1).flatten(0, 1))


@pytest.mark.parametrize("cls", MODELS)
def test_left_padding_does_not_change_results(cls):
    """Padding spanning a whole extra segment and part of another gives the unpadded row's logits."""
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=4).eval()
    short, long = torch.randint(0, V, (1, 6)), torch.randint(0, V, (1, 13))
    ids = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    batched = model(lm_batch(ids, mask)).logits
    alone = model(lm_batch(short)).logits
    torch.testing.assert_close(batched[:6], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[6:], model(lm_batch(long)).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", MODELS)
def test_iter_logits_equals_forward(cls):
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=5).eval()
    ids = torch.randint(0, V, (2, 17))
    chunks = list(model.iter_logits(ids))
    assert [c.shape[1] for c in chunks] == [2, 5, 5, 5]
    torch.testing.assert_close(torch.cat(chunks, 1).flatten(0, 1), model(lm_batch(ids)).logits)


def reachable(k2: int, n: int) -> torch.Tensor:
    """(t, s) True where the loss at segment t must reach segment s: blocks of k2 + 1 segments from the right."""
    block = torch.zeros(n, dtype=torch.long) if k2 < 0 else (n - 1 - torch.arange(n)) // (k2 + 1)
    t, s = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (s <= t) & (block[:, None] == block[None, :])


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("k2", [-1, 0, 1, 2])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_gradients_stop_exactly_at_depth_k2(cls, k2, checkpoint):
    """Segment s uses its own token ids; the loss at segment t gives their embeddings a gradient iff reachable."""
    torch.manual_seed(0)
    n, L = 5, 3
    model = cls(
        tiny_backbone(vocab_size=n * L), num_memory=2, segment_size=L, k2=k2, checkpoint_segments=checkpoint
    )
    ids = torch.arange(n * L)[None]  # segment s holds tokens s*L .. s*L+L-1
    expected = reachable(k2, n)
    for t in range(n):
        model.zero_grad()
        labels = torch.full_like(ids, -100)
        labels[0, t * L + L - 1] = 0
        out = model({"input_ids": ids, "labels": labels})
        F.cross_entropy(out.logits, out.targets).backward()
        grad = model.backbone.embed_tokens.weight.grad.view(n, L, -1)
        got = grad.abs().sum((1, 2)) > 0
        assert got.tolist() == expected[t].tolist(), f"loss at segment {t}"
        # M_0 enters segment 0, or (ARMT's layout) every segment's write tokens, read from the next segment on
        paper_armt = isinstance(model, ARMT) and not model.rmt_tokens
        m0_reaches = expected[t, :t].any() if paper_armt else expected[t, 0]
        assert (model.memory.grad is not None and bool(model.memory.grad.any())) == bool(m0_reaches)


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize(
    "k2,answer_at,expected", [(1, 4, [3, 4]), (1, 2, [1, 2]), (0, 4, [4]), (-1, 2, [0, 1, 2])]
)
def test_segments_no_loss_reaches_run_without_a_graph(cls, k2, answer_at, expected):
    """Only the segments from which the answer back-propagates keep activations (the gradients themselves are
    test_gradients_stop_exactly_at_depth_k2's); the rest run as under no_grad, with the same outputs."""
    torch.manual_seed(0)
    n, L = 5, 3
    model = cls(tiny_backbone(), num_memory=2, segment_size=L, k2=k2)
    ids = torch.randint(0, V, (2, n * L))
    labels = torch.full_like(ids, -100)
    labels[:, answer_at * L + 1] = ids[:, answer_at * L + 1]
    with_graph = []
    model.backbone.register_forward_hook(lambda *_: with_graph.append(torch.is_grad_enabled()))
    out = model({"input_ids": ids, "labels": labels})
    assert [i for i, g in enumerate(with_graph) if g] == expected
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model({"input_ids": ids, "labels": labels}).logits)


def test_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = RMT(tiny_backbone(), num_memory=2, segment_size=4, checkpoint_segments=checkpoint)
        ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
        out = model(lm_batch(ids))
        F.cross_entropy(out.logits, out.targets).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("cls", MODELS)
def test_generate_answers_at_the_last_segment(cls):
    """The first greedy token is forward's argmax at the last prompt position; generation stops at EOS."""
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch = lm_batch(ids, mask)
    batch["labels"] = torch.full_like(ids, -100)
    batch["labels"][:, -1] = 0
    first = model(batch).logits.argmax(-1)
    free = model.generate(ids, 3, eos_id=-1, attention_mask=mask)
    assert [row[0] for row in free] == first.tolist() and all(len(row) == 3 for row in free)
    eos = int(first[0])
    stopped = model.generate(ids, 3, eos_id=eos, attention_mask=mask)
    assert stopped[0] == [eos]
    assert stopped[1] == free[1][: len(stopped[1])] and (len(stopped[1]) == 3 or stopped[1][-1] == eos)


@pytest.mark.parametrize("cls", MODELS)
def test_stream_mode_carries_memory_and_resets_rows(cls):
    """Two stream batches of one segment each equal one batch of two segments; a reset row starts afresh."""
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 8))
    whole = model(lm_batch(ids)).logits.view(2, 8, V)
    model({**lm_batch(ids[:, :4]), "reset": torch.tensor([True, True])})
    second = model({**lm_batch(ids[:, 4:]), "reset": torch.tensor([False, True])}).logits.view(2, 4, V)
    torch.testing.assert_close(second[0], whole[0, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[1], model(lm_batch(ids[1:, 4:])).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", MODELS)
def test_memory_reset_every_segment_sees_only_the_segment(cls):
    """recurrent=False (eval.babilong.memory=reset): a segment's logits are those of the segment alone, whatever
    came before; with memory carried they depend on the earlier segments."""
    torch.manual_seed(0)
    model = cls(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (2, 12))
    other = torch.cat([torch.randint(0, V, (2, 8)), ids[:, 8:]], 1)  # other first two segments, same last one
    batch, last = lm_batch(ids), lm_batch(ids[:, 8:])
    for b in (batch, lm_batch(other)):
        b["labels"][:, :8] = -100  # score the last segment only
        torch.testing.assert_close(model(b, recurrent=False).logits, model(last).logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        model(batch).logits, model(lm_batch(other) | {"labels": batch["labels"]}).logits
    )


def recall_batch(n: int, L: int, n_values: int, gen: torch.Generator) -> dict:
    """Segment 1: filler with one value token at a random place; segment 2: filler, then a query; target = value."""
    filler = torch.randint(n_values + 1, 2 * n_values + 1, (n, 2 * L), generator=gen)
    values = torch.randint(0, n_values, (n,), generator=gen)
    filler[torch.arange(n), torch.randint(0, L, (n,), generator=gen)] = values
    filler[:, -1] = n_values  # the query token
    labels = torch.full_like(filler, -100)
    labels[:, -1] = values
    return {"input_ids": filler, "labels": labels}


def train_recall(recurrent: bool, steps: int = 150) -> float:
    torch.manual_seed(0)
    n_values, L = 8, 6
    model = RMT(tiny_backbone(vocab_size=2 * n_values + 1, hidden=32, layers=2), num_memory=2, segment_size=L)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = recall_batch(32, L, n_values, gen)
        logits = model.backbone.head(model.scored_hidden(batch, recurrent=recurrent))
        loss = F.cross_entropy(logits, batch["labels"][batch["labels"] != -100])
        opt.zero_grad()
        loss.backward()
        opt.step()
    batch = recall_batch(256, L, n_values, gen)
    with torch.no_grad():
        logits = model.backbone.head(model.eval().scored_hidden(batch, recurrent=recurrent))
    return (logits.argmax(-1) == batch["labels"][:, -1]).float().mean().item()


def test_memory_carries_a_fact_across_segments():
    """The fact sits in segment 1, the question in segment 2: RMT learns it, the memory-reset twin cannot."""
    assert train_recall(recurrent=True) > 0.9
    assert train_recall(recurrent=False) < 0.35


def test_builder_and_bad_arguments():
    assert build_rmt(tiny_backbone(), num_memory=4, segment_size=8, k2=2).segment_bounds(20) == [
        (0, 4),
        (4, 12),
        (12, 20),
    ]
    with pytest.raises(ValueError, match="k2 must be -1"):
        RMT(tiny_backbone(), num_memory=4, segment_size=8, k2=-2)
    with pytest.raises(ValueError, match="segment_size must be >= 1"):
        RMT(tiny_backbone(), num_memory=4, segment_size=0)
    with pytest.raises(ValueError, match="num_memory must be >= 1"):
        RMTRetrieval(tiny_backbone(), num_memory=0, segment_size=8)
    with pytest.raises(ValueError, match="memory_scale .* must be > 0, got 0"):
        RMT(tiny_backbone(), num_memory=4, segment_size=8, memory_scale=0)


@pytest.mark.parametrize("cls", [RMT, RMTRetrieval, active_armt])
def test_every_wrapper_parameter_is_made_on_the_backbones_device(cls):
    """A wrapper built around a backbone already on a device makes its own modules there (retrieval, associative
    memories): found on CUDA (tests/test_gpu.py), checked here on the meta device, which any CPU has."""
    model = cls(tiny_backbone().to("meta"), num_memory=2, segment_size=4)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def tiny_gpt2() -> HFBackbone:
    cfg = GPT2Config(
        vocab_size=V,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return HFBackbone(GPT2LMHeadModel(cfg))


def test_wraps_a_hugging_face_backbone():
    """GPT-2 through HFBackbone: zero memory equals the model itself; left padding changes nothing."""
    torch.manual_seed(0)
    bb = tiny_gpt2().eval()
    ids = torch.randint(0, V, (2, 9))
    bare = RMT(bb, num_memory=0, segment_size=9).eval()
    torch.testing.assert_close(
        bare(lm_batch(ids)).logits, bb.model(ids).logits.flatten(0, 1), atol=1e-5, rtol=1e-5
    )
    model = RMT(bb, num_memory=2, segment_size=4).eval()
    padded = torch.cat([torch.zeros(2, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(2, 5, dtype=torch.long), torch.ones_like(ids)], 1)
    torch.testing.assert_close(
        model(lm_batch(padded, mask)).logits, model(lm_batch(ids)).logits, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("alibi, stick", [(False, 0), (True, 0), (True, 2), (False, 4)])
def test_attention_probs_reproduce_the_layer_output(alibi, stick):
    """The probabilities re-derived from an attention layer's inputs give back the layer's output; they sum to 1
    in softmax heads and at most 1 in stick-breaking ones (the first `stick`)."""
    torch.manual_seed(0)
    bb = tiny_backbone(alibi=alibi, stick_breaking_heads=stick).eval()
    seen = []
    bb.layers[1].self_attn.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    ids = torch.randint(0, V, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    bb(ids, attention_mask=mask)
    (x, rope_for, mask_for, *_), out = seen[0]
    attn = bb.layers[1].self_attn
    probs = attention_probs(attn, x, rope_for, mask_for)  # (B, H, T, T)
    v = attn.v_proj(x).view(2, 7, 2, -1).transpose(1, 2).repeat_interleave(2, dim=1)
    torch.testing.assert_close(attn.o_proj((probs @ v).transpose(1, 2).reshape(2, 7, -1)), out)
    torch.testing.assert_close(probs[:, stick:].sum(-1), torch.ones(2, 4 - stick, 7))
    assert (probs[:, :stick].sum(-1) <= 1 + 1e-6).all() and (probs[:, :stick].sum(-1) < 0.999).all()


def test_memory_panels_and_their_one_figure():
    """Distance map over M_0..M_n; write/read attention maps with our Llama, only the distance map for HF models;
    all samples' panels in one figure (a row each)."""
    torch.manual_seed(0)
    model = RMT(tiny_backbone(), num_memory=2, segment_size=4).eval()
    ids = torch.randint(0, V, (14,))
    states = memory_states(model, ids)
    assert states.shape == (5, 2 * 32)
    torch.testing.assert_close(states[0], model.memory.flatten())
    panels = memory_panels(model, ids, torch.ones_like(ids))
    assert set(panels) == {"distance", "write", "read"}
    assert panels["distance"].values.shape == (5, 5)
    assert panels["read"].values.shape == (4, 2)  # last segment's tokens x read memory
    armt = active_armt(
        tiny_backbone(), num_memory=2, segment_size=4
    ).eval()  # the paper's layout: no read memory
    armt_panels = memory_panels(armt, ids)
    assert set(armt_panels) == {"distance", "write"} and armt_panels["write"].xlabel == "segment tokens"
    hf = RMT(tiny_gpt2(), num_memory=2, segment_size=4).eval()
    hf_panels = memory_panels(hf, ids)
    assert set(hf_panels) == {"distance"}
    fig = memory_figure([panels, hf_panels])
    assert [len(ax.images) for ax in fig.axes if ax.get_label() != "<colorbar>"] == [1, 1, 1, 1]
    assert_texts_inside(fig)
    with pytest.raises(TypeError, match="need our Llama backbone"):
        attention_maps(hf, hf.initial_state(1), ids[None, :4])
    marked = memory_figure([memory_panels(model, ids, facts=(1, 3))])
    assert [line.get_xdata()[0] for line in marked.axes[0].lines[::2]] == [1, 3]  # dotted at M_1 and M_3


def test_fact_segments_finds_each_fact_in_story_order():
    """Segments of 4 split from the right of 14 tokens: [0,2) [2,6) [6,10) [10,14); a fact is placed by its last
    token (the segment after which memory holds all of it), and a later fact equal to an earlier one is found after
    it."""
    ids = np.array([9, 1, 2, 9, 9, 9, 9, 9, 1, 2, 9, 3, 9, 9])
    bounds = RMT(tiny_backbone(), num_memory=1, segment_size=4).segment_bounds(len(ids))
    assert fact_segments(ids, [np.array([1, 2]), np.array([1, 2]), np.array([3])], bounds) == [2, 3, 4]
    with pytest.raises(ValueError, match="not in the sample"):
        fact_segments(ids, [np.array([3]), np.array([1, 2])], bounds)


@pytest.mark.parametrize("cls", [RMT, RMTRetrieval])
def test_alibi_free_memory_takes_the_recency_bias_off_read_and_write_memory(cls):
    """Every layer sees the linear bias among the segment's tokens and none to or from the memory tokens
    ([read memory (r); X (L); write memory (m)]); a backbone without ALiBi is refused by name."""
    torch.manual_seed(0)
    model = cls(tiny_backbone(alibi=True), num_memory=2, segment_size=5, alibi_free_memory=True).eval()
    seen = []
    model.backbone.layers[0].self_attn.register_forward_pre_hook(lambda mod, args: seen.append(args[2]))
    model(lm_batch(torch.randint(0, V, (2, 5))))
    r = 2 if cls is RMT else 4
    T = r + 5 + 2
    i = torch.arange(T)
    distance = (i[:, None] - i[None, :]).float()
    memory = (i < r) | (i >= r + 5)
    distance[memory, :], distance[:, memory] = 0, 0
    slopes = torch.tensor([2 ** (-8 * h / 4) for h in range(1, 5)])
    expected = (-slopes[:, None, None] * distance).masked_fill(i[None, :] > i[:, None], -torch.inf)
    torch.testing.assert_close(seen[0](T), expected[None])
    with pytest.raises(ConfigError, match="needs a backbone with ALiBi"):
        cls(tiny_backbone(), num_memory=2, segment_size=5, alibi_free_memory=True)
