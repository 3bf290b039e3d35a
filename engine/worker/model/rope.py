"""Rotary position embeddings: inverse frequencies for each RoPE type (default, linear,
llama3, yarn) as transformers computes them, and the cos / signed sin a step's positions need.
A model whose layer kinds rotate differently (Gemma 3: base 10,000 on sliding layers, the
config's RoPE on full ones) holds one ``RotaryEmbedding`` per kind."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.worker.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, sliding: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the cos/sin scale for the RoPE type
    (``sliding``: of the sliding layers, where ``config.sliding_rope_theta`` sets their own)."""
    sliding = sliding and config.sliding_rope_theta is not None
    dim = config.head_dim
    theta = config.sliding_rope_theta if sliding else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = None if sliding else config.rope_scaling
    if params is None:
        return inv_freq, 1.0
    rope_type, factor = params["rope_type"], params.get("factor")
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        old_context = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(inv_freq, params, dim, theta, config.max_context_len)


def _yarn(inv_freq: torch.Tensor, params: dict, dim: int, theta: float, max_context: int
          ) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between (arXiv:2309.00071)."""
    old_context = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_context / old_context

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device, sliding: bool = False) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, sliding)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] for absolute positions [T], computed in float32:
        sin's first half is negated so that ``apply_rope`` (engine/worker/attention/base.py) needs no
        negation per layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
        return cos.to(dtype), sin.to(dtype)
