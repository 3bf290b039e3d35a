"""scripts/bench_gpu.py: the floor arithmetic, the Llama-3-8B config it writes, and one
``--tiny`` run on the CPU end to end (runner decode and prefill, the offline engine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.worker.model.config import ModelConfig
from engine.worker.model.llama import LlamaForCausalLM

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"
_spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
bench_gpu = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu"] = bench_gpu  # dataclasses look their module up there
_spec.loader.exec_module(bench_gpu)


def test_hbm_floor_of_llama3_8b_at_batch_64():
    # 8,030,261,248 bf16 parameters; per token and layer, K and V of 8 heads x 128 in bf16.
    weight_bytes = 8_030_261_248 * 2
    kv_bytes = bench_gpu.kv_read_bytes(64, 2048, 32, 8, 128, 2)
    assert kv_bytes == 64 * 2048 * 32 * 4096 == 17_179_869_184
    floor = bench_gpu.hbm_floor_seconds(weight_bytes, kv_bytes, 4.3e12)
    assert floor == pytest.approx((16_060_522_496 + 17_179_869_184) / 4.3e12)
    assert floor == pytest.approx(7.7303e-3, rel=1e-4)


def test_written_config_has_llama3_8b_shapes(tmp_path):
    bench_gpu.write_config(tmp_path, bench_gpu.LLAMA3_8B)
    config = ModelConfig.from_dir(tmp_path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        32, 32, 8, 128)
    assert config.rope_theta == 500000.0 and not config.tie_word_embeddings
    model = LlamaForCausalLM(config, torch.device("meta"), torch.bfloat16, None)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


@pytest.mark.e2e
def test_tiny_run_reports_every_part(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fraction of floor" in proc.stdout and "on / off" in proc.stdout
    report = json.loads(out.read_text())
    assert report["bandwidth"]["measured_copy_rate"] > 0
    assert report["runner"]["attention_backend"] == "torch"
    decode = report["decode"]
    assert [row["batch"] for row in decode] == list(bench_gpu.TINY.batches)
    for row in decode:
        assert row["step_ms"] > 0 and row["floor_ms"] > 0 and row["fraction_of_floor"] > 0
    assert report["prefill"]["tokens_per_s"] > 0
    engine = report["engine"]
    tiny = bench_gpu.TINY
    for run in (engine["on"], engine["off"]):
        assert run["output_tokens"] == tiny.groups * tiny.per_group * tiny.output_len
        assert run["output_tokens_per_s"] > 0
    assert engine["on"]["hit_rate"] > 0.3
    assert engine["off"]["hit_rate"] < 0.05
