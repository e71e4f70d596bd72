"""Tiny models shared by the tests: reference causal LMs and tiny task models (our Llama, a Hugging Face Llama,
ARMT with its memory switched on)."""

import math

import torch
from torch import nn
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from models.armt import ARMT
from models.backbone import HFBackbone, build_llama
from models.lm import CausalLM

VOCAB = 32


class TinyCausalLM(nn.Module):
    """Token + learned position embeddings, pre-norm causal transformer blocks; positions start at 0 per row."""

    def __init__(
        self, seed: int, vocab_size: int = VOCAB, dim: int = 32, n_layers: int = 2, max_len: int = 64
    ):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.tok = nn.Embedding(vocab_size, dim)
            self.pos = nn.Embedding(max_len, dim)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(n_layers)
            )
            self.head = nn.Linear(dim, vocab_size)
            nn.init.normal_(self.head.weight, std=0.3)  # peaked predictions: LSD spreads over a useful range
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(n, device=input_ids.device))  # (B, T, D)
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(x)  # (B, T, V)


def last_logprob(model: nn.Module, context: torch.Tensor, target: torch.Tensor) -> float:
    """log P(target | context) from one forward over the context alone."""
    return model(context[None])[0, -1].log_softmax(-1)[target].item()


def brute_force_logprobs(model: nn.Module, tokens: torch.Tensor, K: int, d: int) -> tuple[torch.Tensor, ...]:
    """Per token j >= 1, one forward per context: (long, short, has_short), each (T,), index 0 NaN / False."""
    n = tokens.numel()
    long, short = torch.full((n,), math.nan), torch.full((n,), math.nan)
    has_short = torch.zeros(n, dtype=torch.bool)
    with torch.no_grad():
        for j in range(1, n):
            block_start = (j // d) * d
            long[j] = last_logprob(model, tokens[:j], tokens[j])
            has_short[j] = block_start >= K
            short[j] = (
                last_logprob(model, tokens[block_start - K : j], tokens[j]) if has_short[j] else long[j]
            )
    return long, short, has_short


def tiny_llama_lm(
    vocab_size: int = VOCAB, window: int = 64, seed: int = 0, hidden_size: int = 32, init_std: float = 0.02
) -> CausalLM:
    """CausalLM over our Llama (2 layers), eval mode; a large init_std gives peaked, context-dependent predictions."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        backbone = build_llama(
            vocab_size, hidden_size, 2, 4, 2, 2 * hidden_size, max_positions=4 * window, init_std=init_std
        )
    return CausalLM(backbone, window=window).eval()


def tiny_hf_llama_lm(vocab_size: int = VOCAB, window: int = 64, seed: int = 0) -> CausalLM:
    """CausalLM over HFBackbone(a Hugging Face LlamaForCausalLM built in memory, 2 layers), eval mode."""
    config = HFLlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * window,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        hf = LlamaForCausalLM(config)
    return CausalLM(HFBackbone(hf), window=window).eval()


def active_armt(backbone: nn.Module, rmt_tokens: bool = False, **kwargs) -> ARMT:
    """ARMT whose associative memory acts from the start: W_V random (it starts at zero, which keeps A = 0)."""
    model = ARMT(backbone, rmt_tokens=rmt_tokens, **kwargs)
    for memory in model.layer_memories:
        nn.init.normal_(memory.v_proj.weight, std=0.3)
    return model
