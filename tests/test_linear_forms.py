"""The forms of a quantized linear layer (engine/worker/model/linear_forms.py): each forced in
turn against the float64 product of the format's numbers at every shape the default model uses,
the widening kernel (csrc/quant_widen.cpp) and the resident copy against dequantize_weight
bit for bit, the row buckets, the resident copies' memory cap, and the choices cached beside a
checkpoint. Which form the timing picks is never asserted."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from engine.worker.model import linear_forms
from engine.worker.model.linear_forms import (
    FORMS,
    MEASURED_ROWS,
    RESIDENT_MIN_ROWS,
    Scratch,
    bucket,
    bucket_label,
    choose_forms,
    pin,
)
from engine.worker.model.quant import QuantizedLinear, quantized_linear
from tests.test_cpu_kernels import load_variants
from tests.test_quant import FORMATS, SHAPES, random_weight

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


def layer_of(fmt: str, rows: int, cols: int, seed: int) -> tuple[QuantizedLinear, torch.Tensor]:
    """A block layer of a random ``fmt`` weight, and that weight's numbers in float64."""
    p = random_weight(fmt, rows, cols, seed)
    layer = QuantizedLinear(fmt, rows, cols, CPU)
    for part, tensor in layer.parts().items():
        tensor.copy_(getattr(p, part))
    layer.repack()
    layer.scratch = Scratch()
    return layer, p.dequantize().double()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_widening_kernel_gives_dequantize_weights_numbers(fmt):
    """Every row of every format widened into bf16 and float32 buffers (a view into a wider
    one: any row stride) is what dequantize_weight gives, bit for bit."""
    layer, _ = layer_of(fmt, 40, 160, seed=1)
    for dtype in (torch.bfloat16, torch.float32):
        wide = torch.zeros(40, 200, dtype=dtype)
        layer.ops.widen_weight(list(layer.kernel), layer.bits, layer.rows, wide[:, 20:180])
        assert torch.equal(wide[:, 20:180], layer.dense(dtype)), (fmt, dtype)
        assert not wide[:, :20].any() and not wide[:, 180:].any()


@pytest.mark.parametrize("variant", ["native", "avx2", "portable"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_build_widens_what_it_dequantizes(variants, variant, fmt):
    """Each build of the kernels (16 interleaved rows, or 8 in the AVX2 one) widens its own
    layout to its dequantize_weight's numbers, bit for bit, at odd sizes: rows not a whole
    group, one block, a K-quant super-block cut short."""
    ops = variants[variant]
    for rows, cols in ((33, 96), (7, 32), (17, 288)):
        p = random_weight(fmt, rows, cols, seed=rows)
        blocks = tuple(ops.quant_repack(*p.repack_args()))
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(rows, cols, dtype=dtype)
            ops.widen_weight(list(blocks), p.bits, rows, out)
            want = ops.dequantize_weight(*blocks, p.bits, rows, torch.arange(rows), dtype)
            assert torch.equal(out, want), (variant, fmt, rows, cols, dtype)


def test_the_widening_kernel_refuses_what_is_not_quant_repacks_layout():
    layer, _ = layer_of("q4_1", 40, 160, seed=2)
    qweight, scales, mins = layer.kernel[:3]
    out = torch.empty(40, 160, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out must be bfloat16 or float32"):
        layer.ops.widen_weight(list(layer.kernel), 4, 40, out.half())
    with pytest.raises(RuntimeError, match="out \\[40, 160\\]"):
        layer.ops.widen_weight(list(layer.kernel), 4, 40, out[:, :128])
    with pytest.raises(RuntimeError, match="does not match"):
        layer.ops.widen_weight(list(layer.kernel), 4, 60, torch.empty(60, 160))
    with pytest.raises(RuntimeError, match="need mins"):
        layer.ops.widen_weight([qweight, scales, mins[:0]], 4, 40, out)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "q6_k", "int8"])
def test_each_form_is_the_float64_product_at_the_models_shapes(form, fmt):
    """With the form pinned for the rows' dtype, x @ W.T at SmolLM2-135M's shapes (its LM head
    with few rows) and odd ones, bf16 and float32 rows, against float64 over the format's own
    numbers: the widened and resident forms round the weights to bf16 where the activations
    are bf16 (about 2^-9 of a weight), the block kernel quantizes the activations to int8
    (about 1/127 of a block's largest: 1.5% of a one-row product at most here); bf16 outputs
    round to 2^-9."""
    tolerance = {"blocks": 0.03, "widened": 0.008, "resident": 0.008}[form]
    generator = torch.Generator().manual_seed(3)
    for rows, cols in SHAPES:
        layer, weight = layer_of(fmt, rows, cols, seed=rows + cols)
        counts = (1, 5) if rows > 10000 else (1, 17, 40, 300)
        for dtype in (torch.bfloat16, torch.float32):
            pin(layer, form, dtype)
            for count in counts:
                x = torch.randn(count, cols, generator=generator).to(dtype)
                bias = torch.randn(rows, generator=generator).to(dtype)
                want = x.double() @ weight.T + bias.double()
                got = layer(x, bias)
                assert got.dtype == dtype and got.shape == (count, rows)
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < tolerance, (form, fmt, rows, cols, count, dtype, err)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k", "q6_k"])
def test_the_resident_copy_holds_dequantize_weights_numbers(fmt):
    """The resident form's copy (oneDNN's layout for bf16, a plain matrix for float32) is
    dequantize_weight's numbers bit for bit: the identity's rows times it give W.T exactly (one
    product per sum). It is counted in the layer's bytes under its dtype."""
    layer, _ = layer_of(fmt, 96, 256, seed=8)
    for dtype in (torch.bfloat16, torch.float32):
        pin(layer, "resident", dtype)
        eye = torch.eye(layer.cols, dtype=dtype)
        wide = layer.resident[1]
        assert torch.equal(layer(eye).to(wide), layer.dense(wide).t()), (fmt, dtype)
        assert layer.bytes_by_format() == {fmt: layer.nbytes, str(wide).removeprefix("torch."):
                                           96 * 256 * wide.itemsize}
    pin(layer, "blocks", torch.bfloat16)
    assert layer.resident is None and layer.bytes_by_format() == {fmt: layer.nbytes}


def test_a_weight_larger_than_the_scratch_is_widened_a_tile_of_row_groups_at_a_time(
        monkeypatch):
    """A tile smaller than the weight (and not a whole number of tiles of it) gives what one
    tile does, bit for bit."""
    layer, _ = layer_of("q4_1", 300, 96, seed=4)
    pin(layer, "widened", torch.bfloat16)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    whole = layer(x)
    monkeypatch.setattr(linear_forms, "TILE_BYTES", 40 * 96 * 2)  # 32 rows: two groups
    layer.scratch = Scratch()
    tiled = layer(x)
    assert torch.equal(tiled, whole)
    assert layer.scratch._buffer.numel() <= 32 * 96 * 2


def test_in_blocks_a_rows_result_does_not_depend_on_its_batch():
    """Pinned to the block kernel, each row of a 300-row call is bit for bit the row alone:
    the switch a deterministic mode pins (``--linear-form blocks``)."""
    layer, _ = layer_of("q4_1", 960, 576, seed=6)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(7)).bfloat16()
    pin(layer, "blocks", torch.bfloat16)
    batch = layer(x)
    for row in (0, 17, 299):
        assert torch.equal(layer(x[row:row + 1]), batch[row:row + 1])


def test_a_call_takes_the_bucket_of_the_nearest_measured_row_count():
    assert [bucket(rows) for rows in (1, 2, 3, 16, 17, 64, 65, 256, 257, 8192)] == [
        0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [bucket(rows) for rows in MEASURED_ROWS] == list(range(len(MEASURED_ROWS)))
    assert [bucket_label(i) for i in range(len(MEASURED_ROWS))] == [
        "1-2", "3-16", "17-64", "65-256", "257+"]


class _Model(nn.Module):
    """What choose_forms walks: modules with a ``quantized`` dict (a mixed projection's runs
    each; the embedding, read by rows, skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.quantized = {}
        for name, formats, rows in (("qkv", ("q4_k", "q4_k", "q6_k"), (64, 32, 32)),
                                    ("down", ("q4_1",), (96,)), ("embed", ("q8_0",), (64,))):
            layer = quantized_linear(formats, rows, 256, CPU)
            for start, fmt, count in zip((0, rows[0], sum(rows[:2])), formats, rows,
                                         strict=False):
                p = random_weight(fmt, count, 256, seed=count)
                for part, tensor in layer.parts(slice(start, start + count)).items():
                    tensor.copy_(getattr(p, part))
            layer.repack()
            self.quantized[name] = layer


def test_forms_are_timed_once_and_cached_beside_the_checkpoint_for_this_cpu(tmp_path, caplog,
                                                                         monkeypatch):
    """auto times each distinct weight (a mixed projection's runs apart) and writes the choices
    under this CPU's key; a second start reads them without timing; another CPU's entry is kept
    beside it. Pinned policies set every bucket and time nothing."""
    model = _Model()
    caplog.set_level(logging.INFO, "radixserve.worker")
    table = choose_forms(model, "auto", torch.bfloat16, tmp_path)
    assert set(table) == {"q4_k 96x256 bfloat16", "q6_k 32x256 bfloat16",
                          "q4_1 96x256 bfloat16"}
    assert all(set(forms) == {bucket_label(i) for i in range(len(MEASURED_ROWS))}
               and set(forms.values()) <= set(FORMS) for forms in table.values())
    saved = json.loads((tmp_path / "linear_forms.json").read_text())
    (key, entry), = saved.items()
    assert entry["cpu"] == linear_forms.cpu_name() and entry["measured_seconds"] > 0
    assert set(entry["forms"]) == set(table)
    saved["another cpu"] = {"forms": {}}
    (tmp_path / "linear_forms.json").write_text(json.dumps(saved))

    def no_timing(*args: object) -> None:
        raise AssertionError("timed again although cached")

    monkeypatch.setattr(linear_forms, "measure", no_timing)
    assert choose_forms(_Model(), "auto", torch.bfloat16, tmp_path) == table
    assert set(json.loads((tmp_path / "linear_forms.json").read_text())) == {key, "another cpu"}
    for form in FORMS:
        pinned = _Model()
        table = choose_forms(pinned, form, torch.bfloat16, None)
        assert all(set(forms.values()) == {form} for forms in table.values())
        assert pinned.quantized["qkv"].runs[1].forms == (form,) * len(MEASURED_ROWS)
    with pytest.raises(ValueError,
                       match="linear_form must be one of auto, blocks, widened, resident"):
        choose_forms(_Model(), "amx", torch.bfloat16, None)


def _layers(model: _Model) -> list[QuantizedLinear]:
    return [run for name, layer in model.quantized.items() if name != "embed"
            for run in getattr(layer, "runs", [layer])]


def test_the_resident_form_is_offered_only_within_its_memory_cap(tmp_path):
    """auto offers the resident form when every layer's copy fits ``resident_bytes``, from
    ``RESIDENT_MIN_ROWS`` rows; a layer keeps its copy exactly when one of its buckets takes
    it. Under the cap by one byte nothing is copied, and the choices are cached apart (a
    changed cap times again rather than read choices made with or without copies)."""
    need = sum(layer.rows * layer.cols * 2 for layer in _layers(_Model()))
    model = _Model()
    table = choose_forms(model, "auto", torch.bfloat16, tmp_path, resident_bytes=need)
    small = {bucket_label(i) for i, rows in enumerate(MEASURED_ROWS) if rows < RESIDENT_MIN_ROWS}
    for forms in table.values():
        assert all(forms[label] != "resident" for label in small)
    for layer in _layers(model):
        assert (layer.resident is not None) == ("resident" in layer.forms)
    model = _Model()
    table = choose_forms(model, "auto", torch.bfloat16, tmp_path, resident_bytes=need - 1)
    assert all("resident" not in forms.values() for forms in table.values())
    assert all(layer.resident is None for layer in _layers(model))
    assert len(json.loads((tmp_path / "linear_forms.json").read_text())) == 2


def test_a_checkpoint_directory_that_cannot_be_written_is_timed_at_each_start(
        tmp_path, caplog, monkeypatch):
    def refuse(*args: object) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(linear_forms, "update_json", refuse)
    caplog.set_level(logging.INFO, "radixserve.worker")
    assert choose_forms(_Model(), "auto", torch.bfloat16, tmp_path)
    assert "linear forms not cached (PermissionError: read-only file system)" in caplog.text
