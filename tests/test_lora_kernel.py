"""The compiled LoRA kernel (``lora_bgmv``, engine/worker/csrc/lora_bgmv.cpp) against a float64
reference in every build of the kernels (tests/test_cpu_kernels.py), and the LoRA step's use of
it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.worker import lora_pool
from engine.worker.lora_pool import LoraPool
from engine.worker.model.lora import LoraWeights, projection_shapes
from tests.test_cpu_kernels import VARIANTS, load_variants


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def lora_case(x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int = 0):
    """Odd sizes (37 inputs, 301 outputs: a whole tile and a part), five slots of 24 rows in
    use to 24, 0, 7, 16 and 24, and 15 rows mixing them with rows of the base model (-1): six
    of slot 2, more than one block of rows sharing its weights. Slot 4's B is block-diagonal as
    a fused projection's: rows 0-11 reach outputs 0-149, rows 12-22 the others, row 23 none."""
    gen = torch.Generator().manual_seed(seed)
    a_slots = torch.randn(5, 24, 37, generator=gen).to(w_dtype)
    b_slots = torch.randn(5, 24, 301, generator=gen).to(w_dtype)
    widths = torch.tensor([24, 0, 7, 16, 24])
    spans = torch.tensor([0, 301]).repeat(5, 24, 1)
    b_slots[4, :12, 150:] = 0
    b_slots[4, 12:, :150] = 0
    b_slots[4, 23] = 0
    spans[4, :12] = torch.tensor([0, 150])
    spans[4, 12:] = torch.tensor([150, 301])
    spans[4, 23] = 0
    row_slots = torch.tensor([2, -1, 0, 3, 2, 1, 4, -1, 0, 2, 3, 2, 2, 2, 0])
    x = torch.randn(15, 37, generator=gen).to(x_dtype)
    out = torch.randn(15, 301, generator=gen).to(x_dtype)
    return x, a_slots, b_slots, row_slots, widths, spans, out


def lora_reference(x, a_slots, b_slots, row_slots, widths, out) -> torch.Tensor:
    """out + B[s] (A[s] x) per row (B held transposed), in float64, over each slot's rows in
    use, every column of B read."""
    want = out.double()
    for i, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            width = int(widths[slot])
            a, b = a_slots[slot, :width].double(), b_slots[slot, :width].double()
            want[i] += b.t() @ (a @ x[i].double())
    return want


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_lora_bgmv_matches_float64_reference(variants, variant, x_dtype, w_dtype) -> None:
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(x_dtype, w_dtype)
    got = out.clone()
    variants[variant].lora_bgmv(x, a_slots, b_slots, row_slots, widths, spans, got)
    want = lora_reference(x, a_slots, b_slots, row_slots, widths, out)
    # float32 sums, then one rounding to out's dtype
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x_dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5 * want.abs().max().item())
    untouched = (row_slots < 0) | (widths[row_slots.clamp_min(0)] == 0)
    assert torch.equal(got[untouched], out[untouched])  # base-model rows and empty slots


def test_lora_bgmv_builds_agree_and_rows_do_not_depend_on_their_neighbours(variants) -> None:
    """A row's sums run in one order whether it shares its slot's weight loads with three
    other rows or not."""
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(torch.float32, torch.bfloat16)
    together = out.clone()
    variants["native"].lora_bgmv(x, a_slots, b_slots, row_slots, widths, spans, together)
    for i in range(len(x)):
        alone = out[i : i + 1].clone()
        variants["native"].lora_bgmv(x[i : i + 1], a_slots, b_slots, row_slots[i : i + 1],
                                     widths, spans, alone)
        assert torch.equal(alone[0], together[i])


def test_lora_bgmv_refuses_what_it_cannot_read(variants) -> None:
    x, a_slots, b_slots, row_slots, widths, spans, out = lora_case(torch.float32, torch.float32)
    op = variants["native"].lora_bgmv
    with pytest.raises(RuntimeError, match="row 2 names slot 5 of 5"):
        op(x, a_slots, b_slots, torch.where(row_slots == 0, 5, row_slots), widths, spans, out)
    with pytest.raises(RuntimeError, match="slot 0 has width 25 of at most 24"):
        op(x, a_slots, b_slots, row_slots, widths + 1, spans, out)
    with pytest.raises(RuntimeError, match=r"b_slots \[L, R, out\]"):
        op(x, a_slots, b_slots.transpose(1, 2).contiguous(), row_slots, widths, spans,
           out[:, :24])
    with pytest.raises(RuntimeError, match="out .* of x's dtype"):
        op(x, a_slots, b_slots, row_slots, widths, spans, out.bfloat16())
    with pytest.raises(RuntimeError, match="row_slots int64"):
        op(x, a_slots, b_slots, row_slots.int(), widths, spans, out)
    with pytest.raises(RuntimeError, match=r"spans int64 \[L, R, 2\]"):
        op(x, a_slots, b_slots, row_slots, widths, spans[:, :, 0], out)


def random_adapter(config, rank: int, seed: int) -> LoraWeights:
    """Every projection of every layer adapted, its parts' A stacked and B block-diagonal
    (held transposed, as load_adapter holds it)."""
    gen = torch.Generator().manual_seed(seed)
    mats = {}
    for layer in range(config.num_layers):
        for name, (width, outs) in projection_shapes(config).items():
            a = torch.randn(len(outs) * rank, width, generator=gen)
            b = torch.block_diag(*[torch.randn(part, rank, generator=gen) for part in outs])
            mats[(layer, name)] = (a, b.t().contiguous())
    return LoraWeights(f"random{seed}", rank, str(seed), mats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_step_takes_the_op_on_cpu_and_the_segmented_form_without(variants, monkeypatch,
                                                                      dtype) -> None:
    """The same updates through the op (slots in the model's dtype, bf16 or float32) and through
    torch's segmented form (float32 slots), for a prefill chunk past the first rows."""
    config = SimpleNamespace(num_layers=2, hidden_size=40, intermediate_size=72, num_heads=4,
                             num_kv_heads=2, head_dim=10)
    pools = [LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=dtype)]
    monkeypatch.setattr(lora_pool, "lora_bgmv_op", lambda: None)
    pools.append(LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"),
                          dtype=dtype))
    assert pools[0].kernel is not None and pools[1].kernel is None
    assert pools[0].dtype == dtype and pools[1].dtype == torch.float32
    # adapters 1 and 2 of ranks 8 and 3, sequences under 1, none, 2 and 1
    lora_ids, extend_lens = np.array([1, 0, 2, 1]), np.array([5, 2, 3, 1])
    for pool in pools:
        for lora_id, rank in ((1, 8), (2, 3)):
            pool.add(lora_id, random_adapter(config, rank, lora_id))
    steps = [pool.prepare(lora_ids, extend_lens) for pool in pools]
    # q, k and v take outputs 0-39, 40-59 and 60-79; adapter 1's rank rows 0-7, 8-15 and 16-23
    spans = pools[0].spans[(1, "qkv")][pools[0].resident[1], :24]
    assert spans.unique_consecutive(dim=0).tolist() == [[0, 40], [40, 60], [60, 80]]
    gen = torch.Generator().manual_seed(0)
    for name, (width, outs) in projection_shapes(config).items():
        x = torch.randn(7, width, generator=gen).to(dtype)
        out = torch.randn(7, sum(outs), generator=gen).to(dtype)
        got = [out.clone() for _ in steps]
        for step, result in zip(steps, got, strict=True):
            step.add_(1, name, x, result, start=4)
        # rows 0 and 6: adapter 1; 1 and 2: the base model; 3 to 5: adapter 2
        scale = (got[1] - out).abs().max().item()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=tolerance * scale)
        assert torch.equal(got[0][1:3], out[1:3])
        assert not torch.equal(got[0][0], out[0]) and not torch.equal(got[0][6], out[6])


@pytest.mark.parametrize("lora_ids", [[2, 1, 2, 1], [3, 2, 1], [2, 2, 1, 1], [1, 1, 2, 3]],
                         ids=["alternating", "reversed", "grouped", "in-slot-order"])
def test_every_row_adapted_in_any_slot_order_gets_its_own_adapters_update(
        variants, monkeypatch, lora_ids) -> None:
    """Steps where no row runs the base model, their sequences in an order other than their
    slots' (a step's adapters take slots in id order here; the segmented form gathers rows in
    slot order and must add each delta back to its own row) and in slot order (where it adds
    them in place): the torch form and the op both add each token's own adapter's update, as
    a float64 reference computes it."""
    config = SimpleNamespace(num_layers=1, hidden_size=40, intermediate_size=72, num_heads=4,
                             num_kv_heads=2, head_dim=10)
    lora_ids, extend_lens = np.array(lora_ids), np.arange(2, 2 + len(lora_ids))
    adapters = {lora_id: random_adapter(config, rank, lora_id)
                for lora_id, rank in ((1, 8), (2, 3), (3, 5))}
    pools = {"op": LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"),
                            dtype=torch.float32)}
    monkeypatch.setattr(lora_pool, "lora_bgmv_op", lambda: None)
    pools["torch"] = LoraPool(config, max_loras=3, max_rank=8, device=torch.device("cpu"),
                              dtype=torch.float32)
    steps = {}
    for form, pool in pools.items():
        for lora_id, weights in adapters.items():
            pool.add(lora_id, weights)
        steps[form] = pool.prepare(lora_ids, extend_lens)
    assert pools["op"].kernel is not None and pools["torch"].kernel is None
    used = sorted(set(lora_ids.tolist()))
    assert dict(pools["torch"].resident) == {i: slot for slot, i in enumerate(used)}
    token_ids = np.repeat(lora_ids, extend_lens)
    gen = torch.Generator().manual_seed(1)
    for name, (width, outs) in projection_shapes(config).items():
        x = torch.randn(len(token_ids), width, generator=gen)
        out = torch.randn(len(token_ids), sum(outs), generator=gen)
        want = out.double()
        for row, lora_id in enumerate(token_ids.tolist()):
            a, bt = adapters[lora_id].mats[(0, name)]
            want[row] += bt.double().t() @ (a.double() @ x[row].double())
        for form, step in steps.items():
            got = out.clone()
            step.add_(0, name, x, got)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4,
                                       msg=f"{form} {name}")
