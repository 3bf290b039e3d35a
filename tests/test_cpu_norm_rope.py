"""The compiled RMSNorm and rotary-embedding kernels (``rms_norm``, ``rope_store``;
engine/worker/csrc/) against transformers' and torch's arithmetic in every build of the kernels
(tests/test_cpu_kernels.py), and the model's and backend's use of them."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_kernels
from tests.test_attention import make_pool, random_batch
from tests.test_cpu_kernels import VARIANTS, backend, load_variants


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, back to the weight's dtype, scale."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(weight.dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.float16),
])
@pytest.mark.parametrize("rows,hidden", [(1, 256), (37, 576), (300, 100)])
def test_rms_norm_matches_transformers_arithmetic(variants, variant, x_dtype, w_dtype, rows,
                                                   hidden) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden + 7, generator=gen) * 3)[:, :hidden].to(x_dtype)  # strided
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(w_dtype)
    got = variants[variant].rms_norm(x, weight, 1e-6)
    want = torch_rms_norm(x, weight, 1e-6)
    assert got.dtype == w_dtype and got.shape == (rows, hidden)
    if w_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        # Sums taken in another order may round a normalised value to the neighbouring
        # bf16/fp16 number: at most one unit in the last place, on few elements.
        ulp = 2.0**-7 if w_dtype == torch.bfloat16 else 2.0**-10
        diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert diff.max() <= 2 * ulp and (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_rms_norm_takes_the_op_on_cpu_rows_and_torch_elsewhere(variants, monkeypatch,
                                                                      dtype) -> None:
    """The model's ``rms_norm`` on 2-D rows calls the compiled op; with it unavailable (or on
    3-D per-head inputs) the torch formulation gives the same values."""
    from engine.worker.model import layer_ops

    calls = []
    op = cpu_kernels.rms_norm_op()
    monkeypatch.setattr(layer_ops, "rms_norm_op", lambda: lambda *a: calls.append(1) or op(*a))
    x = torch.randn(5, 64, dtype=torch.float32)
    weight = (1 + torch.randn(64) / 4).to(dtype)
    fused = layer_ops.rms_norm(x, weight, 1e-5)
    layer_ops.rms_norm(x.view(5, 4, 16).to(dtype), weight[:16], 1e-5)  # per head: torch
    assert len(calls) == 1
    monkeypatch.setattr(layer_ops, "rms_norm_op", lambda: None)
    plain = layer_ops.rms_norm(x, weight, 1e-5)
    assert plain.dtype == fused.dtype == dtype
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2 ** -7, atol=1e-6)


def rope_case(tokens: int, dtype: torch.dtype, heads: int = 8, kv_heads: int = 4,
              head_dim: int = 64, seed: int | None = None):
    """A step's fused qkv rows (q and k strided views, as the model splits them) and its
    cos / signed sin, as the model's RotaryEmbedding gives them (drawn from ``seed``, else
    from ``tokens``)."""
    gen = torch.Generator().manual_seed(tokens if seed is None else seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    angles = torch.arange(tokens).float()[:, None] * torch.rand(head_dim // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(dtype)
    return qk, v, cos, signed_sin


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope_store_is_apply_rope_and_the_pool_write(variants, variant, dtype, tokens) -> None:
    from engine.worker.attention.base import apply_rope

    qk, v, cos, signed_sin = rope_case(tokens, dtype)
    want_q, want_k = apply_rope(qk, cos, signed_sin).split([8, 4], dim=1)
    k_slots = torch.zeros(1000, 4, 64, dtype=dtype)
    v_slots = torch.zeros(1000, 4, 64, dtype=dtype)
    slots = torch.randperm(1000)[:tokens]
    q = variants[variant].rope_store(qk[:, :8], qk[:, 8:], v, cos, signed_sin, slots, k_slots,
                                     v_slots)
    assert q.is_contiguous() and q.shape == want_q.shape and q.dtype == dtype
    # The same roundings as torch's ops (bit-identical on this CPU; at most one unit in the
    # last place where torch's elementwise kernels round otherwise).
    tight = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(q, want_q, rtol=tight, atol=tight)
    torch.testing.assert_close(k_slots[slots], want_k, rtol=tight, atol=tight)
    assert torch.equal(v_slots[slots], v)
    untouched = torch.ones(1000, dtype=torch.bool)
    untouched[slots] = False
    assert not k_slots[untouched].any() and not v_slots[untouched].any()


def test_rope_store_refuses_slots_outside_the_pool(variants) -> None:
    qk, v, cos, signed_sin = rope_case(3, torch.float32)
    k_slots = torch.zeros(10, 4, 64)
    with pytest.raises(RuntimeError, match="slot 10 is outside the pool of 10"):
        variants["native"].rope_store(qk[:, :8], qk[:, 8:], v, cos, signed_sin,
                                      torch.tensor([0, 10, 2]), k_slots, k_slots.clone())
    with pytest.raises(RuntimeError, match="model's dtype"):
        variants["native"].rope_store(qk[:, :8], qk[:, 8:], v, cos.bfloat16(), signed_sin,
                                      torch.tensor([0, 1, 2]), k_slots, k_slots.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_rotating_forward_is_apply_rope_then_forward(variants, dtype) -> None:
    """The model's two ways into a layer's attention agree: q and k rotated by the model then
    ``forward``, or rotated and stored by the backend in ``forward_rotating``."""
    from engine.worker.attention.base import apply_rope

    outs, pools = [], []
    pool = make_pool(16, dtype=dtype)
    before = pool.kv.clone()
    for rotating in (True, False):
        pool.kv.copy_(before)
        attention = backend(pool, True)
        assert attention._rope_store is not None
        batch = random_batch(16, pool.num_pages, [(30, 1), (0, 7), (47, 1), (5, 3)])
        qkv = torch.randn(batch.num_tokens, 12, 16, generator=torch.Generator().manual_seed(3))
        qk, v = qkv[:, :10].to(dtype), qkv[:, 10:].to(dtype)
        angles = torch.arange(batch.num_tokens).float()[:, None] * 0.1 * torch.arange(8)
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(dtype)
        signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(dtype)
        attention.plan(batch)
        if rotating:
            outs.append(attention.forward_rotating(0, qk, v, cos, signed_sin))
        else:
            q, k = apply_rope(qk, cos, signed_sin).split([8, 2], dim=1)
            outs.append(attention.forward(0, q, k, v))
        pools.append(pool.kv.clone())
    assert not torch.equal(pools[0], before)  # this step's K and V went in
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pools[0], pools[1], rtol=1e-5, atol=1e-5)
