"""The profiler's cache sizes in bytes: a model's KV bytes per token, read from its config or
GGUF metadata (never its weights) and counted as the worker's pool counts them; --cache-gb
and --host-cache-gb in whole pages; refusals without a shape; the sweep's 8-bit view."""

from __future__ import annotations

import csv
import json

import gguf
import numpy as np
import pytest
import torch

from engine.cli import main
from engine.profiler.kv_bytes import (
    GIB,
    KV_CACHE_DTYPES,
    VALUE_BYTES,
    KVBytes,
    KVShape,
    format_bytes,
    read_shape,
)
from engine.worker.kv_pool import KVPool
from engine.worker.model.config import ModelConfig

SMALL_MULTI_TURN = ["--conversations", "4", "--turns", "4", "--system-len", "60",
                    "--turn-len", "20", "--output-len", "12"]
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A float32 Llama: 2 layers, 4 query heads over 2 KV heads, head_dim 64 (256 / 4)."""
    from tests.conftest_models import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("model"), "llama", hidden_size=256)


@pytest.fixture(scope="module")
def bf16_config(checkpoint, tmp_path_factory):
    """The same shape declared bfloat16, as a directory holding config.json alone: nothing
    else is read."""
    directory = tmp_path_factory.mktemp("config-only")
    config = json.loads((checkpoint / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return directory


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "multi-turn.jsonl"
    assert main(["workload", "gen", "multi-turn", "--seed", "3", "--out", str(path),
                 *SMALL_MULTI_TURN]) == 0
    return path


def test_bytes_per_token_of_a_checkpoint_by_hand(checkpoint):
    shape = read_shape(checkpoint)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 64)
    assert shape.model_dtype == "float32"  # auto: what its config.json declares
    # 2 (K and V) x 2 layers x 2 KV heads x row bytes
    assert shape.bytes_per_token("auto") == 2 * 2 * 2 * 64 * 4 == 2048
    assert shape.bytes_per_token("bfloat16") == 2 * 2 * 2 * 64 * 2 == 1024
    assert shape.bytes_per_token("int8") == 2 * 2 * 2 * (64 + 2) == 528
    engine = ModelConfig.from_dir(checkpoint)  # how the worker reads the same config
    assert (engine.num_layers, engine.num_kv_heads, engine.head_dim) == (2, 2, 64)


def test_the_pool_spends_the_same_bytes_for_every_kv_cache_dtype():
    assert set(KV_CACHE_DTYPES) - {"auto"} == set(VALUE_BYTES)
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=24, model_dtype="bfloat16",
                    source="test")
    for name in VALUE_BYTES:
        pool_page = KVPool.bytes_per_page(num_layers=3, page_size=16, num_kv_heads=2,
                                          head_dim=24, dtype=TORCH_DTYPES[name])
        assert pool_page == 16 * shape.bytes_per_token(name), name


def test_a_gguf_file_gives_its_shape_from_metadata(tmp_path):
    directory = tmp_path / "gguf-dir"
    directory.mkdir()
    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(3)
    writer.add_embedding_length(256)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)  # head_dim: 256 / 8, no key_length given
    writer.add_tensor("token_embd.weight", np.zeros((4, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for given in (path, directory):  # the file, or the directory holding only it
        shape = read_shape(given)
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (3, 2, 32)
        assert shape.bytes_per_token("auto") == 2 * 3 * 2 * 32 * 2  # bfloat16: names none


def test_int8_holds_at_least_1_9x_the_tokens_of_bf16_at_head_dim_64(checkpoint):
    shape = read_shape(checkpoint)
    assert shape.head_dim == 64
    bf16, int8 = KVBytes.of_model(shape, "bfloat16"), KVBytes.of_model(shape, "int8")
    for gib in (0.5, 16, 80):
        assert int8.pages(gib, 16) >= 1.9 * bf16.pages(gib, 16)
    assert bf16.compared() == int8.compared() == {"float32": 2048, "int8": 528}


def test_cache_gb_and_host_cache_gb_are_whole_pages(checkpoint, trace, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["profile", str(trace), "--checkpoint", str(checkpoint), "--kv-cache-dtype",
                 "bfloat16", "--cache-gb", "0.001", "--host-cache-gb", "0.004", "--page-size",
                 "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    pages = int(0.001 * GIB) // (1024 * 4)  # 1,024 bytes a bfloat16 token, 4 tokens a page
    host_tokens = int(0.004 * GIB) // (1024 * 4) * 4
    assert pages == 262
    assert f"cache: {pages * 4:,} tokens = {pages:,} pages x 4 = 1.0 MiB" in printed
    assert "KV: bfloat16, 1,024 bytes a token = 2 x 2 layers x 2 KV heads x 64 x 2" in printed
    assert f"host tier of {host_tokens:,} tokens ({format_bytes(host_tokens * 1024)})" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["num_pages"] == pages
    assert summary["config"]["cache_bytes"] == pages * 4 * 1024
    assert summary["caches"][0]["capacity_bytes"] == pages * 4 * 1024
    assert summary["host_tier"]["capacity_tokens"] == host_tokens
    assert summary["kv"]["bytes_per_token"] == 1024 and summary["kv"]["kv_dtype"] == "bfloat16"

    assert main(["profile", str(trace), "--kv-bytes-per-token", "1000", "--cache-gb", "0.001",
                 "--page-size", "4"]) == 0
    assert f"{int(0.001 * GIB) // 4000:,} pages x 4" in capsys.readouterr().out


def test_sizes_in_bytes_are_refused_without_a_shape(checkpoint, trace, tmp_path, capsys):
    needs = "needs the bytes of a cached token: pass --checkpoint DIR|FILE.gguf"
    assert main(["profile", str(trace), "--cache-gb", "1"]) == 2
    assert f"--cache-gb {needs}" in capsys.readouterr().err
    assert main(["profile", str(trace), "--host-cache-gb", "4"]) == 2
    assert f"--host-cache-gb {needs}" in capsys.readouterr().err
    assert main(["profile", str(trace), "--kv-cache-dtype", "int8"]) == 2
    assert "--kv-cache-dtype int8 sizes a model's KV rows" in capsys.readouterr().err
    assert main(["profile", str(trace), "--checkpoint", str(checkpoint), "--cache-gb",
                 "0.000001"]) == 2
    assert "--cache-gb 1e-06 holds no page: a page of 16 tokens takes 32.0 KiB" in \
        capsys.readouterr().err
    assert main(["profile", str(trace), "--checkpoint", str(tmp_path)]) == 2
    assert "holds no config.json and no .gguf file" in capsys.readouterr().err
    assert main(["profile", str(trace), "--cache-gb", "-1"]) == 2
    assert "must be positive" in capsys.readouterr().err
    for both in (["--cache-gb", "1", "--cache-tokens", "4096"],
                 ["--host-cache-gb", "1", "--host-cache-tokens", "4096"],
                 ["--checkpoint", str(checkpoint), "--kv-bytes-per-token", "100"]):
        with pytest.raises(SystemExit):
            main(["profile", str(trace), *both])
    capsys.readouterr()


def test_the_sweep_shows_what_int8_buys_at_the_same_bytes(bf16_config, trace, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["profile", str(trace), "--checkpoint", str(bf16_config), "--page-size", "4",
                 "--sweep", "288,384,576,864", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "int8 tokens  int8 hit rate" in printed
    assert "int8 KV holds 1.94x the tokens of bfloat16 KV (1,024 and 528 bytes a token)" in printed
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["cache_tokens"]) for r in rows] == [288, 384, 576, 864]
    for row in rows:
        cache_bytes = int(row["cache_bytes"])
        assert cache_bytes == int(row["cache_tokens"]) * 1024
        assert int(row["bfloat16_tokens"]) == int(row["cache_tokens"])
        assert row["bfloat16_hit_rate"] == row["radix_hit_rate"]
        assert int(row["int8_tokens"]) == cache_bytes // (528 * 4) * 4
        assert float(row["int8_hit_rate"]) >= float(row["bfloat16_hit_rate"])
    assert any(float(r["int8_hit_rate"]) > float(r["bfloat16_hit_rate"]) for r in rows)
    assert (out / "hit_rate_vs_cache_size.png").stat().st_size > 0
