"""One layer's associative memory of ARMT (Rodkin et al. 2024, "Associative Recurrent Memory Transformer", Sec. 3).

A matrix A (F, D) and a normaliser z (F,) store key -> value associations. Keys and queries go through the DPFP
feature map (Schlag et al. 2021, "Linear Transformers Are Secretly Fast Weight Programmers", Sec. 5.1), L2-normalised:

    phi(x) = normalise([r_a r_{a+1}]_a; ...; [r_a r_{a+nu}]_a),  r = [relu(x); relu(-x)], indices mod 2d  (F = 2 nu d)

    read(q)  = A^T phi(q) / (z^T phi(q))                            (0 while nothing is written: A = 0)
    write    k_i = phi(W_K m_i), v_i = W_V m_i, beta_i = sigmoid(W_beta m_i) for the memory tokens m_i (m, D):
             v_bar_i = read(k_i)                                    (what A already holds under k_i)
             A <- A + sum_i beta_i phi(k_i) (v_i - v_bar_i)^T       (delta rule: a re-written key replaces its value)
             z <- z + sum_i gamma_i phi(k_i),  gamma_i = clip(1 - z^T phi(k_i) / |phi(k_i)|^2, 0, 1), no gradient
                                                                    (a key already in z is not counted twice)

`use_denom=False` (the reference implementation's switch of the same name) drops the normaliser and applies the m
writes in turn, the delta rule of DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers
with the Delta Rule over Sequence Length", Eq. 2), in closed form (WY form: one m x m triangular solve):

    read(q) = A^T phi(q);   for i = 1..m:  A <- A + beta_i phi(k_i) (v_i - A^T phi(k_i))^T

Each step is a contraction along its key (phi(k)^T A <- (1 - beta) phi(k)^T A + beta v), whatever the length. With
the normaliser, a key that z barely covers (z^T phi(k) = c << 1) gets phi(k)^T A <- (1 - beta / c) phi(k)^T A + beta v,
and m overlapping keys written at once add up their corrections: A can grow without bound over hundreds of segments
(measured: |A| in the thousands after 128 segments, for a model trained on 2).

A holds at most F linearly independent keys: DPFP-nu gives 2 nu d features from a d-dimensional key, and keys whose
features overlap interfere. W_V starts at zero, as in the reference implementation, so A stays 0 and a new ARMT
computes exactly what the model without it does until training moves W_V. The memory is kept and computed in
float32 whatever the autocast dtype (it accumulates over millions of tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EPS = 1e-5  # keeps the normalised read finite where z^T phi(q) = 0 (nothing written yet: the read is 0)


def dpfp(x: Tensor, nu: int) -> Tensor:
    """DPFP-nu features (..., 2 nu d) of x (..., d), not normalised."""
    r = torch.cat([F.relu(x), F.relu(-x)], -1)  # (..., 2d)
    return torch.cat([r * r.roll(-j, -1) for j in range(1, nu + 1)], -1)  # r_a r_{a+j}


def read(A: Tensor, z: Tensor, phi_q: Tensor, use_denom: bool = True) -> Tensor:
    """A^T phi(q) / (z^T phi(q)), or A^T phi(q) without the denominator: A (B, F, D), z (B, F), phi_q (B, T, F)
    -> (B, T, D)."""
    if not use_denom:
        return phi_q @ A
    return (phi_q @ A) / ((phi_q @ z[..., None]) + EPS)


def delta_write(
    A: Tensor, z: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, use_denom: bool = True
) -> tuple[Tensor, Tensor]:
    """A, z after writing m associations: phi_k (B, m, F) unit-norm keys, v (B, m, D), beta (B, m, 1). With the
    normaliser all at once (ARMT); without it one after another (`sequential_delta_write`), z unchanged."""
    if not use_denom:
        return sequential_delta_write(A, phi_k, v, beta), z
    stored = read(A, z, phi_k)  # (B, m, D)
    A = A + phi_k.transpose(1, 2) @ (beta * (v - stored))  # (B, F, D)
    gamma = (1 - phi_k @ z[..., None]).clamp(0, 1).detach()  # (B, m, 1); |phi(k)| = 1
    return A, z + (gamma * phi_k).sum(1)


def sequential_delta_write(A: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
    """A (B, F, D) after A <- A + beta_i phi_i (v_i - A^T phi_i)^T for i = 1..m in turn, in closed form:
    A' = A + Phi^T U with (I + diag(beta) tril(Phi Phi^T, -1)) U = diag(beta) (V - Phi A)."""
    m = phi_k.shape[1]
    gram = (phi_k @ phi_k.transpose(1, 2)).tril(-1)  # (B, m, m): phi_i . phi_j for j < i
    lower = torch.eye(m, device=A.device, dtype=A.dtype) + beta * gram
    U = torch.linalg.solve_triangular(lower, beta * (v - phi_k @ A), upper=False)  # (B, m, D)
    return A + phi_k.transpose(1, 2) @ U


class LayerMemory(nn.Module):
    """The projections of one layer's associative memory: queries, keys (D -> d_mem), values (D -> D), beta."""

    def __init__(self, dim: int, d_mem: int, nu: int, use_denom: bool = True):
        super().__init__()
        self.nu, self.use_denom = nu, use_denom
        self.q_proj = nn.Linear(dim, d_mem, bias=False)
        self.k_proj = nn.Linear(dim, d_mem, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.beta_proj = nn.Linear(dim, 1)
        nn.init.zeros_(self.v_proj.weight)

    def features(self, x: Tensor) -> Tensor:
        """Unit-norm DPFP features (..., F) of x (..., d_mem)."""
        return F.normalize(dpfp(x, self.nu), dim=-1)

    def read(self, A: Tensor, z: Tensor, hidden: Tensor) -> Tensor:
        """What each token (B, T, D) reads: (B, T, D) in the hidden states' dtype."""
        with torch.autocast(hidden.device.type, enabled=False):
            return read(A, z, self.features(self.q_proj(hidden.float())), self.use_denom).to(hidden.dtype)

    def write(self, A: Tensor, z: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        """A (B, F, D), z (B, F) after writing the memory tokens' hidden states (B, m, D)."""
        with torch.autocast(memory.device.type, enabled=False):
            m = memory.float()
            beta = torch.sigmoid(self.beta_proj(m))  # (B, m, 1)
            return delta_write(A, z, self.features(self.k_proj(m)), self.v_proj(m), beta, self.use_denom)
