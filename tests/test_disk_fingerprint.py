"""What names the disk tier's directory (engine/worker/tier_io.py's ``identity``): everything
that changes a KV block's bytes. Servers of one GGUF with ``--quantization none`` and ``auto``
(and int8, int4) hold different weights, so different KV: their fingerprints differ, as do
those of another dtype, KV dtype or page size. A GGUF is named by its content, not its
conversion's file times; other checkpoints by their files. Every engine option is either in
the identity or declared not to change KV bytes, so a new option cannot be forgotten; an
adapter's blocks hash apart by its content."""

from __future__ import annotations

import hashlib
import os
import shutil

import gguf
import msgspec
import pytest

from engine.checkpoints.gguf import CONVERTER_VERSION, gguf_checkpoint
from engine.contracts.disk_blocks import block_hashes, fingerprint
from engine.contracts.engine_config import EngineConfig
from engine.contracts.lora import LoraAdapterInfo, lora_namespace
from engine.worker.tier_io import IN_IDENTITY, NOT_IN_IDENTITY, identity
from tests.test_gguf import write_gguf


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> tuple:
    """A small Llama GGUF of Q4_1 tensors and its converted directory."""
    root = tmp_path_factory.mktemp("gguf")
    path = write_gguf(root / "tiny.gguf", gguf.GGMLQuantizationType.Q4_1)
    return path, gguf_checkpoint(path, root / "cache")


def served_identity(model_dir, **options) -> dict:
    """The identity a worker with ``options`` on ``model_dir`` names its directory by."""
    from engine.worker.runner import ModelRunner

    config = EngineConfig(model=str(model_dir), device="cpu", num_pages=8,
                          **{"dtype": "float32", **options})
    return identity(config, ModelRunner(config))


def test_every_weight_format_has_a_fingerprint_of_its_own(gguf_model):
    """One GGUF served with --quantization none (every weight widened to --dtype), auto (the
    file's own Q4_1 blocks), int8 and int4 (quantized at load): four sets of weights, four
    fingerprints, each naming the format of every weight that is not dense."""
    from engine.worker.cpu_kernels import quant_ops

    if quant_ops() is None:
        pytest.skip("the compiled CPU kernels that serve quantized weights are not built here")
    _, converted = gguf_model
    served = {q: served_identity(converted, quantization=q)
              for q in ("none", "auto", "int8", "int4")}
    assert len({fingerprint(i) for i in served.values()}) == 4
    assert served["none"]["weight_formats"] == {}
    assert set(served["auto"]["weight_formats"].values()) == {"q4_1"}
    assert "layers.1.qkv" in served["auto"]["weight_formats"]
    assert set(served["int8"]["weight_formats"].values()) == {"int8"}


@pytest.mark.parametrize("option,values", [("dtype", ("float32", "bfloat16")),
                                           ("kv_cache_dtype", ("auto", "int8")),
                                           ("page_size", (16, 4))])
def test_dtypes_and_pages_have_fingerprints_of_their_own(gguf_model, option, values):
    _, converted = gguf_model
    first, second = (served_identity(converted, quantization="none", **{option: v})
                     for v in values)
    assert fingerprint(first) != fingerprint(second)


def test_a_gguf_is_named_by_its_content(gguf_model, tmp_path):
    """A converted GGUF's identity is the file's own sha256 and the converter's version: its
    conversion's files touched (or converted again elsewhere) leave it, another file's bytes
    change it."""
    path, converted = gguf_model
    before = served_identity(converted, quantization="none")["weights"]
    assert before == {"gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                      "converter": CONVERTER_VERSION}
    copy = tmp_path / "converted"
    shutil.copytree(converted, copy)
    for file in copy.iterdir():
        os.utime(file, ns=(10**9, 10**9))
    assert served_identity(copy, quantization="none")["weights"] == before
    source = (copy / "source.json").read_text().replace(before["gguf_sha256"], "0" * 64)
    (copy / "source.json").write_text(source)
    assert served_identity(copy, quantization="none")["weights"] != before


def test_another_checkpoints_files_name_it(harness_model_dir, tmp_path):
    """A checkpoint directory (not a GGUF) is named by its weight and config files' names,
    sizes and modification times: a weight file rewritten changes the fingerprint."""
    copy = tmp_path / "model"
    shutil.copytree(harness_model_dir, copy)
    before = served_identity(copy)
    (copy / "model.safetensors").touch()
    os.utime(copy / "model.safetensors", ns=(10**9, 10**9))
    assert fingerprint(served_identity(copy)) != fingerprint(before)


def test_every_option_is_in_the_identity_or_declared_not_to_change_kv(gguf_model):
    """Each EngineConfig field is either held by the identity (under the key IN_IDENTITY
    names, as the worker resolved it) or in NOT_IN_IDENTITY with its reason: an option added
    without deciding which fails here."""
    fields = {f.name for f in msgspec.structs.fields(EngineConfig)}
    undecided = fields - IN_IDENTITY.keys() - NOT_IN_IDENTITY.keys()
    assert not undecided, f"options neither in the disk tier's identity nor declared not to " \
                          f"change KV bytes (engine/worker/tier_io.py): {sorted(undecided)}"
    assert not IN_IDENTITY.keys() & NOT_IN_IDENTITY.keys()
    assert not (IN_IDENTITY.keys() | NOT_IN_IDENTITY.keys()) - fields  # no stale names
    assert all(NOT_IN_IDENTITY.values())
    _, converted = gguf_model
    assert set(IN_IDENTITY.values()) <= served_identity(converted).keys()


def test_an_adapters_blocks_are_named_by_its_content():
    """The same adapter name with other weights (another content hash), another adapter and
    the base model name the same tokens' blocks apart: the namespace in the hash chain's seed
    holds the adapter's content hash."""
    tokens = list(range(64))
    adapters = [None, LoraAdapterInfo("a", 1, 8, "11" * 8), LoraAdapterInfo("a", 1, 8, "22" * 8),
                LoraAdapterInfo("b", 2, 8, "11" * 8)]
    chains = [tuple(block_hashes("cd" * 16, lora_namespace(None, a), tokens, 16))
              for a in adapters]
    assert len(set(chains)) == len(adapters)
    assert len({h for chain in chains for h in chain}) == 4 * len(adapters)
