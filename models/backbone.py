"""Backbones behind one protocol, and their builders (Hydra `_target_`s of `configs/backbone/`).

Protocol (our `Llama` implements it natively; `HFBackbone` adapts any Hugging Face causal LM):
    hidden_size, vocab_size
    embed(input_ids) -> (B, T, D)
    forward(inputs_embeds=..., position_ids=None, attention_mask=None, kv_cache=None, residual_hook=None)
        -> hidden (B, T, D)
    head(hidden) -> logits (..., V)

The two per-layer hooks (`kv_cache` for Llama-XL, `residual_hook` for ARMT) need our Llama: Hugging Face models give
no stable way into their layers, so `HFBackbone` refuses them; a Hugging Face Llama checkpoint loads into our Llama
(`backbone.weights=<hub id or folder>`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.config_errors import ConfigError
from models.llama import Llama, LlamaConfig, padding_position_ids


class HFBackbone(nn.Module):
    """Any `AutoModelForCausalLM` (GPT-2, Llama, SmolLM2 ...) seen through the backbone protocol."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().embedding_dim

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(hidden)

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        kv_cache=None,
        residual_hook=None,
    ) -> Tensor:
        if kv_cache is not None or residual_hook is not None:
            raise ConfigError(
                f"The per-layer {'KV-cache' if kv_cache is not None else 'residual-stream'} hook needs our Llama "
                "backbone (backbone=tiny|llama_83m|smollm2_135m; a Hugging Face Llama loads into it with "
                "backbone.weights=<hub id or folder>)"
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        if attention_mask is not None and position_ids is None:
            position_ids = padding_position_ids(attention_mask)
        out = self.model.base_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return out.last_hidden_state

    def logits(self, input_ids: Tensor, **kwargs) -> Tensor:
        return self.head(self(input_ids, **kwargs))


def build_llama(
    vocab_size: int,
    hidden_size: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_size: int,
    max_positions: int,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-5,
    tie_embeddings: bool = False,
    key_norm: bool = False,
    attn_scale: float | None = None,
    alibi: bool = False,
    stick_breaking_heads: int = 0,
    init_std: float = 0.02,
    embed_init_std: float | None = None,
    weights: str | None = None,
) -> Llama:
    """Our Llama from flat arguments; `weights` optionally names a Hugging Face Llama folder/id to load."""
    model = Llama(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_size=ffn_size,
            max_positions=max_positions,
            rope_theta=rope_theta,
            rms_eps=rms_eps,
            tie_embeddings=tie_embeddings,
            key_norm=key_norm,
            attn_scale=attn_scale,
            alibi=alibi,
            stick_breaking_heads=stick_breaking_heads,
            init_std=init_std,
            embed_init_std=embed_init_std,
        )
    )
    if weights:
        from transformers import AutoModelForCausalLM

        model.load_hf_state_dict(AutoModelForCausalLM.from_pretrained(weights).state_dict())
    return model


def build_hf(name: str, gguf_file: str | None = None, dtype: str = "float32") -> HFBackbone:
    """Any Hugging Face causal LM by hub id or local folder (optionally a GGUF file inside it)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype), **kwargs)
    return HFBackbone(model)
