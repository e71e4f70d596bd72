"""Llama decoder (Touvron et al. 2023): RMSNorm, rotary positions, SwiGLU, grouped-query attention via SDPA.

The module names mirror Hugging Face `LlamaForCausalLM` (minus its `model.` prefix), so weights move both ways
with a prefix change (`from_hf_state_dict` / `to_hf_state_dict`). The backbone knows nothing of memory; it exposes
what memory wrappers need: `inputs_embeds`, explicit `position_ids`, an attention mask, and two per-layer hooks:
`kv_cache` prepends cached keys/values (see `KVCacheHook`; Llama-XL), `residual_hook` sees and may change the
residual stream at every layer boundary (see `ResidualHook`; ARMT). Optional L2 key normalisation and attention
scale are the two architecture switches Llama-XL (Liu et al. 2024, App. D.2) needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config_errors import ConfigError


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 512
    n_layers: int = 12
    n_heads: int = 8
    n_kv_heads: int = 8
    ffn_size: int = 2048
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    key_norm: bool = False  # L2-normalise keys over the head dimension (Llama-XL)
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    alibi: bool = False  # add ALiBi's per-head linear recency bias (Press et al. 2022) to the RoPE attention
    stick_breaking_heads: int = 0  # the first heads attend by stick-breaking (Tan et al. 2024), no RoPE/ALiBi
    init_std: float = 0.02
    embed_init_std: float | None = None  # None: init_std

    def __post_init__(self):
        if self.hidden_size % self.n_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} must be divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}")
        if not 0 <= self.stick_breaking_heads <= self.n_heads:
            raise ConfigError(
                f"stick_breaking_heads must be between 0 and n_heads ({self.n_heads}), got {self.stick_breaking_heads}"
            )
        if self.alibi and self.stick_breaking_heads == self.n_heads:
            raise ConfigError(
                "alibi=true biases the softmax heads, and stick_breaking_heads = n_heads leaves none: set alibi=false "
                "or fewer stick_breaking_heads"
            )
        if (self.hidden_size // self.n_heads) % 2:
            raise ConfigError("head_dim (hidden_size / n_heads) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def score_scale(self) -> float:
        """The factor on q·k: attn_scale, or 1/sqrt(head_dim) when it is None (SDPA's default)."""
        return self.attn_scale or self.head_dim**-0.5


class KVCacheHook(Protocol):
    """Per-layer key/value hook. Given this segment's un-rotated keys/values (B, H_kv, T, hd) of layer `layer`,
    return the keys/values to attend to (cached ones prepended). Positions are then 0..Tk-1 for keys and the
    last Tq of those for queries, with a bottom-right causal mask."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class ResidualHook(Protocol):
    """Per-layer residual-stream hook, called at every layer boundary i = 0..n_layers with the stream x (B, T, D):
    before layer i (its input norm and attention) for i < n_layers, and after the last layer (before the final norm)
    for i = n_layers, where x is also layer i-1's output. Returns the stream to go on with (x, or x plus something)."""

    def __call__(self, layer: int, x: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (B, 1, T, hd) for integer positions (B, T), computed in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def alibi_bias(
    q_pos: Tensor, k_pos: Tensor, n_heads: int, mask: Tensor | None, free: Tensor | None = None
) -> Tensor:
    """Float attention mask (B, H, Tq, Tk): -slope_h * (query position - key position), slopes 2^(-8h/H) for
    h = 1..H, and -inf where `mask` (bool (B|1, 1, Tq, Tk); None: bottom-right causal) forbids attending.
    free: (Tk,) bool, keys (and, the last Tq of them, queries) at distance 0 from every token: no recency bias."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, device=q_pos.device) / n_heads)  # (H,)
    distance = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).clamp(min=0)  # (B, 1, Tq, Tk)
    if free is not None:
        distance = distance.masked_fill(free[-q_pos.shape[1] :, None] | free[None, :], 0)
    if mask is None:
        Tq, Tk = q_pos.shape[1], k_pos.shape[1]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q_pos.device).tril(Tk - Tq)[None, None]
    return (-slopes[:, None, None] * distance).masked_fill(~mask, float("-inf"))


def allowed_keys(mask: Tensor | None, Tq: int, Tk: int, device: torch.device) -> Tensor:
    """Bool (B|1, 1, Tq, Tk), True = attend, from what `mask_for` gives: None (bottom-right causal), a bool mask, or
    an ALiBi bias (-inf where attending is not allowed)."""
    if mask is None:
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(Tk - Tq)[None, None]
    return mask[:, :1].isfinite() if mask.is_floating_point() else mask


def stick_breaking_weights(z: Tensor, allowed: Tensor) -> Tensor:
    """Attention weights (B, H, Tq, Tk) from scores z (B, H, Tq, Tk) by stick-breaking (Tan et al. 2024): key j's
    weight for query i is sigmoid(z_ij) times the product over the allowed keys l in (j, i] of (1 - sigmoid(z_il)).
    The nearest keys take their share of the stick first, so the latest match wins at any distance; the weights sum
    to at most 1. allowed: bool (B|1, 1, Tq, Tk) (`allowed_keys`)."""
    log_rest = F.logsigmoid(-z)  # log(1 - sigmoid(z)); log sigmoid(z) = z + log_rest: one logsigmoid, not two
    passed = log_rest.masked_fill(~allowed, 0.0)
    later = passed.flip(-1).cumsum(-1).flip(-1) - passed  # summed over the allowed keys after j
    return (z + log_rest + later).masked_fill(~allowed, float("-inf")).exp()


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.hidden_size, bias=False)
        if cfg.stick_breaking_heads:  # a key takes sigmoid(-5) = 0.7% of the stick at first: ~150 share it
            self.stick_bias = nn.Parameter(torch.full((cfg.stick_breaking_heads,), -5.0))  # 1-D: no decay

    def stick_weights(self, q: Tensor, k: Tensor, allowed: Tensor) -> Tensor:
        """Weights (B, S, Tq, Tk) of the S stick-breaking heads from their queries (B, S, Tq, hd) and keys
        (B, S, Tk, hd), no positions; allowed: bool (B|1, 1, Tq, Tk)."""
        z = (q @ k.transpose(-1, -2)) * self.cfg.score_scale
        return stick_breaking_weights(z + self.stick_bias[:, None, None], allowed)

    def forward(self, x: Tensor, rope_for, mask_for, cache: KVCacheHook | None, layer: int):
        cfg, (B, T, _) = self.cfg, x.shape
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.key_norm:
            k = F.normalize(k, dim=-1)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # un-rotated, cached ones first: (B, Hkv, Tk, hd)
        mask, S = mask_for(k.shape[2]), cfg.stick_breaking_heads
        if S:  # the first S heads: stick-breaking, no positions (its recency is its own); the others as below
            groups = cfg.n_heads // cfg.n_kv_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # (B, H, Tk, hd)
            allowed = allowed_keys(mask, T, k.shape[2], x.device)
            y_stick = self.stick_weights(q[:, :S], k[:, :S], allowed) @ v[:, :S]
            if S == cfg.n_heads:
                return self.o_proj(y_stick.transpose(1, 2).reshape(B, T, -1))
            q, k, v = q[:, S:], k[:, S:], v[:, S:]
        cos, sin = (t.to(q.dtype) for t in rope_for(k.shape[2]))  # the keys' (B, 1, Tk, hd); queries: last T
        q, k = apply_rope(q, cos[:, :, -T:], sin[:, :, -T:]), apply_rope(k, cos, sin)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)  # an ALiBi bias meets autocast's dtype
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=cfg.attn_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # (B, H - S, T, hd)
        if S:
            y = torch.cat([y_stick, y], 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope_for, mask_for, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), rope_for, mask_for, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def padding_position_ids(attention_mask: Tensor) -> Tensor:
    """Positions (B, T) that skip padding: a left-padded row starts at 0 on its first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_attention_mask(
    attention_mask: Tensor | None, Tq: int, Tk: int, device: torch.device | None = None
) -> Tensor | None:
    """Bottom-right causal mask (B|1, 1, Tq, Tk), True = attend, combined with a (B, Tq|Tk) 0/1 padding mask.

    Returns None for the plain causal case (SDPA's fused `is_causal` path); a 4-D bool mask is passed through.
    Padded queries attend to themselves so that no row is empty.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.bool()
    if Tq == Tk and (attention_mask is None or bool(attention_mask.all())):
        return None
    device = attention_mask.device if attention_mask is not None else device
    q_idx = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)
    mask = (torch.arange(Tk, device=device)[None, :] <= q_idx)[None, None]  # (1, 1, Tq, Tk)
    if attention_mask is not None:
        keys = attention_mask.bool()
        if keys.shape[1] == Tq and Tk > Tq:  # cached keys are all real tokens
            keys = F.pad(keys, (Tk - Tq, 0), value=True)
        diag = torch.arange(Tk, device=device)[None, :] == q_idx
        mask = (mask & keys[:, None, None, :]) | diag[None, None]
    return mask


class Llama(nn.Module):
    """Decoder-only Llama. `forward` returns final-normed hidden states (B, T, D); `head` maps them to logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init(self, m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            embedding = isinstance(m, nn.Embedding) and self.cfg.embed_init_std is not None
            nn.init.normal_(m.weight, std=self.cfg.embed_init_std if embedding else self.cfg.init_std)

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        kv_cache: KVCacheHook | None = None,
        residual_hook: ResidualHook | None = None,
        alibi_free: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, T) or inputs_embeds (B, T, D) -> hidden (B, T, D).

        attention_mask: (B, T) 0/1 padding mask (combined with causal masking) or (B, 1, Tq, Tk) bool.
        position_ids: (B|1, T); default cumsum(mask) - 1, i.e. padding does not shift positions, or 0..T-1.
        kv_cache: per-layer hook prepending cached keys/values; positions then follow the cache (see KVCacheHook).
        residual_hook: called at each layer boundary with the residual stream, returns it (see ResidualHook).
        alibi_free: (T,) bool, tokens outside ALiBi's recency bias, as queries and as keys (an RMT's memory);
            needs alibi=True.
        """
        if alibi_free is not None and not self.cfg.alibi:
            raise ConfigError(
                "alibi_free marks tokens outside ALiBi's recency bias: it needs backbone.alibi=true"
            )
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[1]
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] == T:
                position_ids = padding_position_ids(attention_mask)
            else:
                position_ids = torch.arange(T, device=x.device)[None]  # (1, T): shared by the rows
        masks: dict[int, Tensor | None] = {}
        ropes: dict[int, tuple[Tensor, Tensor]] = {}

        def key_positions(Tk: int) -> Tensor:  # (B|1, Tk): as given, or 0..Tk-1 after a KV cache
            return position_ids if kv_cache is None else torch.arange(Tk, device=x.device)[None]

        def rope_for(Tk: int) -> tuple[Tensor, Tensor]:  # the same for every layer: float32 cos, sin once
            if Tk not in ropes:
                ropes[Tk] = rope_cos_sin(
                    key_positions(Tk), self.cfg.head_dim, self.cfg.rope_theta, torch.float32
                )
            return ropes[Tk]

        def mask_for(Tk: int) -> Tensor | None:  # the same for every layer; built once per key length
            if Tk not in masks:
                mask = build_attention_mask(attention_mask, T, Tk, x.device)
                if self.cfg.alibi:  # key positions as the attention's RoPE sees them
                    k_pos = key_positions(Tk)
                    heads = self.cfg.n_heads - self.cfg.stick_breaking_heads  # the softmax heads
                    mask = alibi_bias(k_pos[:, -T:], k_pos, heads, mask, alibi_free)
                masks[Tk] = mask
            return masks[Tk]

        for i, layer in enumerate(self.layers):
            if residual_hook is not None:
                x = residual_hook(i, x)
            x = layer(x, rope_for, mask_for, kv_cache, i)
        if residual_hook is not None:
            x = residual_hook(len(self.layers), x)
        return self.norm(x)

    def logits(self, input_ids: Tensor, **kwargs) -> Tensor:
        """Convenience: logits (B, T, V) for all positions."""
        return self.head(self(input_ids, **kwargs))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- Hugging Face interop -------------------------------------------------------------------------
    def to_hf_state_dict(self) -> dict[str, Tensor]:
        sd = {
            ("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v
            for k, v in self.state_dict().items()
        }
        if self.cfg.tie_embeddings:
            sd.pop("lm_head.weight")
        return sd

    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        ours = {k.removeprefix("model."): v for k, v in sd.items() if "rotary_emb" not in k}
        if self.cfg.tie_embeddings:
            ours.pop("lm_head.weight", None)
            missing, unexpected = self.load_state_dict(ours, strict=False)
            missing = [k for k in missing if k != "lm_head.weight"]
        else:
            missing, unexpected = self.load_state_dict(ours, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"HF Llama weights do not match this config: missing {missing}, unexpected {unexpected}"
            )

    def hf_config(self):
        from transformers import LlamaConfig as HFLlamaConfig

        c = self.cfg
        if c.alibi or c.stick_breaking_heads:
            raise ConfigError(
                "an ALiBi or stick-breaking backbone (alibi=true, stick_breaking_heads > 0) has no Hugging Face "
                "Llama equivalent to export to"
            )
        return HFLlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.ffn_size,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            max_position_embeddings=c.max_positions,
            rms_norm_eps=c.rms_eps,
            rope_theta=c.rope_theta,
            tie_word_embeddings=c.tie_embeddings,
            attention_bias=False,
            mlp_bias=False,
        )

    @classmethod
    def from_hf(cls, hf_model) -> Llama:
        """Build from a transformers `LlamaForCausalLM` (same weights, same logits)."""
        hc = hf_model.config
        rope = getattr(hc, "rope_parameters", None) or {}
        cfg = LlamaConfig(
            vocab_size=hc.vocab_size,
            hidden_size=hc.hidden_size,
            n_layers=hc.num_hidden_layers,
            n_heads=hc.num_attention_heads,
            n_kv_heads=hc.num_key_value_heads,
            ffn_size=hc.intermediate_size,
            max_positions=hc.max_position_embeddings,
            rope_theta=float(rope.get("rope_theta", getattr(hc, "rope_theta", 10000.0))),
            rms_eps=hc.rms_norm_eps,
            tie_embeddings=bool(hc.tie_word_embeddings),
        )
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"Only default RoPE is supported, got rope_type={rope.get('rope_type')!r}")
        model = cls(cfg)
        model.load_hf_state_dict(hf_model.state_dict())
        return model
