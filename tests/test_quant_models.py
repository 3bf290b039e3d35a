"""Quantized weights in served models: a checkpoint quantized to int8 or int4 once and cached
(again when it is edited), every projection held, partial groups kept dense; tensor parallel's
shards; a GGUF served in its own blocks; a quantized LM head's float32 logits; the loader's
refusals. The formats and kernels themselves: tests/test_quant.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.checkpoints.gguf import gguf_checkpoint
from engine.checkpoints.model_source import weight_files
from engine.checkpoints.quant_formats import PackedWeight, read_formats
from engine.checkpoints.quantized import quantized_file
from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.model import loader
from engine.worker.runner import ModelRunner
from tests.conftest_models import write_checkpoint
from tests.test_gguf import write_gguf
from tests.test_tp import ThreadRank, run_ranks


def steps(vocab: int) -> list[BatchInput]:
    """A prefill of two sequences, then a decode of one and an extend of the other."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, vocab, 7), rng.integers(3, vocab, 5)
    return [BatchInput.build([([3, 7], 0, a[:6]), ([1], 0, b[:3])], 4, "all"),
            BatchInput.build([([3, 7], 6, a[6:]), ([1, 5], 3, b[3:])], 4, "all")]


def forward(model: str, tp: ThreadRank | None = None, **options) -> list[torch.Tensor]:
    config = EngineConfig(model=model, page_size=4, num_pages=16, dtype="float32",
                          attention_backend="torch", **options)
    runner = ModelRunner(config, tp)
    return [runner.forward(step) for step in steps(runner.config.vocab_size)], runner


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A Llama checkpoint whose widths tensor parallel splits in whole blocks (64, 128)."""
    return str(write_checkpoint(tmp_path_factory.mktemp("quant") / "llama", "llama",
                                intermediate_size=128))


def projections(checkpoint: str) -> set[str]:
    """The seven projections of every decoder layer, as the checkpoint names them."""
    layers = json.loads((Path(checkpoint) / "config.json").read_text())["num_hidden_layers"]
    return {f"model.layers.{i}.{name}.weight" for i in range(layers)
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def test_int8_and_int4_quantize_a_checkpoint_once_and_stay_close(checkpoint, tmp_path,
                                                                 monkeypatch):
    """The random checkpoint's logits move by a few percent under int8 and by a third under
    int4 (random weights have no structure for 15 steps a group to follow; the default model's
    figures are in docs/benchmarks.md)."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    dense, runner = forward(checkpoint, quantization="none")
    assert set(runner.weight_formats) == {"float32"}
    for fmt, bound in (("int8", 0.06), ("int4", 0.4)):
        got, runner = forward(checkpoint, quantization=fmt)
        # the projections in blocks; embeddings, norms and the LM head in --dtype
        assert set(runner.weight_formats) == {fmt, "float32"}
        assert relative_error(got, dense) < bound, fmt
        made = list(tmp_path.glob(f"quant-{fmt}-*/quantized.safetensors"))
        assert len(made) == 1
        stamp = made[0].stat().st_mtime_ns
        again, _ = forward(checkpoint, quantization=fmt)  # read from the cache, not made again
        assert made[0].stat().st_mtime_ns == stamp and list(tmp_path.glob(f"quant-{fmt}-*")) == [
            made[0].parent]
        assert all(torch.equal(a, b) for a, b in zip(again, got, strict=True))


def test_int8_and_int4_hold_all_seven_projections_of_every_layer(checkpoint, tmp_path):
    for fmt in ("int8", "int4"):
        made = quantized_file(checkpoint, fmt, tmp_path)
        assert read_formats(made) == dict.fromkeys(projections(checkpoint), fmt)


def test_an_edited_checkpoint_is_quantized_again(checkpoint, tmp_path):
    """The quantized cache's key holds each weight file's size and modification time: a file
    edited in place (same size, a later time) and one of another size carrying the old time
    (copied with its time kept) are each quantized again, from the weights they now hold."""
    model = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    cache = tmp_path / "cache"
    (weights,) = weight_files(model)
    down = "model.layers.0.mlp.down_proj.weight"

    def held(path: Path) -> torch.Tensor:
        with safe_open(str(path), framework="pt") as reader:
            parts = {part: reader.get_tensor(f"{down}.{part}") for part in ("qweight", "scales",
                                                                            "mins")}
        return PackedWeight("int8", **parts).dequantize()

    def edit(scale: float, metadata: dict[str, str], mtime_ns: int) -> None:
        tensors = load_file(weights)
        tensors[down] = tensors[down] * scale
        save_file(tensors, weights, metadata={"format": "pt", **metadata})
        os.utime(weights, ns=(mtime_ns, mtime_ns))

    first = quantized_file(model, "int8", cache)
    before = weights.stat()
    edit(2.0, {}, before.st_mtime_ns + 10**9)  # rewritten in place a second later
    assert weights.stat().st_size == before.st_size
    second = quantized_file(model, "int8", cache)
    assert second != first
    torch.testing.assert_close(held(second), 2 * held(first), rtol=2e-3, atol=1e-4)
    edit(0.5, {"note": "another size"}, before.st_mtime_ns + 10**9)  # the time kept
    assert weights.stat().st_size != before.st_size
    third = quantized_file(model, "int8", cache)
    assert third not in (first, second)
    torch.testing.assert_close(held(third), held(first), rtol=2e-3, atol=1e-4)


def test_tensor_parallel_shards_quantized_blocks(checkpoint):
    """Two ranks (threads) hold whole blocks of each projection and compute what one does:
    the same integer products per block, only summed in another order. That order's rounding
    can move an activation across a quantization step in a later layer, so the logits agree
    to a fraction of what quantizing costs, not to the last bit. Both run the block kernel
    (``linear_form`` blocks): ``auto`` picks each call's form by timing it at load, and a form
    that widens the weights skips the kernel's int8 activations, so two loads on a busy
    machine could differ by more than the split does."""
    for fmt in ("int8", "int4"):
        want, _ = forward(checkpoint, quantization=fmt, linear_form="blocks")
        results = run_ranks(2, lambda tp, fmt=fmt: forward(checkpoint, tp, quantization=fmt,
                                                           linear_form="blocks")[0])
        assert relative_error(results[0], want) < 0.05, fmt


def test_a_gguf_is_served_in_its_own_blocks(tmp_path):
    """--quantization auto (the default) keeps a GGUF's Q8_0, Q4_0 and Q4_1 tensors, the
    embedding included, and computes close to the widened weights; F16 has none to keep."""
    for kind in ("Q8_0", "Q4_0", "Q4_1", "F16"):
        qtype = GGMLQuantizationType[kind]
        directory = str(gguf_checkpoint(write_gguf(tmp_path / f"{kind}.gguf", qtype),
                                        tmp_path / "cache"))
        dense, _ = forward(directory, quantization="none")
        got, runner = forward(directory)
        if kind == "F16":
            assert set(runner.weight_formats) == {"float32"}
            continue
        assert set(runner.weight_formats) == {kind.lower(), "float32"}  # the norms
        assert relative_error(got, dense) < (0.02 if kind == "Q8_0" else 0.1), kind


def test_a_quantized_lm_head_gives_float32_logits_in_bf16(tmp_path):
    """With the model in bf16, a quantized LM head's logits are the kernel's float32 sums, not
    rounded to bf16 (where close candidates would tie, and any small difference upstream would
    decide between them)."""
    directory = str(gguf_checkpoint(write_gguf(tmp_path / "q8.gguf", GGMLQuantizationType.Q8_0),
                                    tmp_path / "cache"))
    runner = ModelRunner(EngineConfig(model=directory, page_size=4, num_pages=16,
                                      dtype="bfloat16", attention_backend="torch"))
    assert "lm_head" in runner.model.quantized
    logits = runner.forward(steps(runner.config.vocab_size)[0])
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())


def test_refusals_name_the_way_out(tmp_path, monkeypatch):
    directory = gguf_checkpoint(write_gguf(tmp_path / "q.gguf", GGMLQuantizationType.Q4_1),
                                tmp_path / "cache")
    quantized = directory / "quantized.safetensors"
    with pytest.raises(ValueError, match=r"int8 keeps .*\(q4_1\).* on cuda with "
                                         r"--quantization auto or none"):
        loader._formats(quantized, "int8", torch.device("cuda"))
    assert loader._formats(quantized, "auto", torch.device("cuda")) == {}  # widened, logged
    # tensor parallel over 2 ranks would cut the MLP's 96 columns into 48 and 48
    with pytest.raises(ValueError, match=r"64 x 48 .* not whole blocks .*--tp-size.*none"):
        run_ranks(2, lambda tp: forward(str(directory), tp))
    with pytest.raises(ValueError, match=r"dummy has no weights to quantize"):
        forward(str(directory), quantization="int8", load_format="dummy")
    monkeypatch.setattr(loader, "quant_ops", lambda: None)  # no compiler on this machine
    with pytest.raises(RuntimeError, match=r"int8 needs the compiled CPU kernels.*none"):
        loader._formats(quantized, "int8", torch.device("cpu"))
    assert loader._formats(quantized, "auto", torch.device("cpu")) == {}  # widened, logged


def test_projections_of_partial_groups_stay_dense_and_say_so(tmp_path, monkeypatch, caplog):
    """int8 and int4 for any checkpoint: the down projections of an MLP 100 wide (three groups
    of 32 and four columns) stay in --dtype, named once in the log; the rest are quantized."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    model = str(write_checkpoint(tmp_path / "llama100", "llama", intermediate_size=100))
    dense, _ = forward(model, quantization="none")
    down = {name for name in projections(model) if "down_proj" in name}
    for fmt, bound in (("int8", 0.06), ("int4", 0.4)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="radixserve.worker"):
            got, runner = forward(model, quantization=fmt)
        assert read_formats(quantized_file(model, fmt)) == dict.fromkeys(
            projections(model) - down, fmt)
        assert set(runner.weight_formats) == {fmt, "float32"}
        assert relative_error(got, dense) < bound, fmt
        said = [r.getMessage() for r in caplog.records if "stay in float32" in r.getMessage()]
        assert len(said) == 1 and all(name in said[0] for name in down), said
