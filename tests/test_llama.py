"""Our Llama against Hugging Face LlamaForCausalLM with the same weights, and the backbone's interface."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from models.llama import Llama, LlamaConfig


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


def test_inputs_embeds_equal_input_ids():
    model = Llama(tiny_cfg()).eval()
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(model(inputs_embeds=model.embed(ids)), model(ids))


def test_bad_config_is_explained():
    with pytest.raises(ValueError, match="divisible by n_kv_heads"):
        tiny_cfg(n_kv_heads=3)
