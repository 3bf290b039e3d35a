"""How many OpenMP threads a model worker gets (engine/runtime/launcher.py ``worker_threads``), that
the launcher hands it to the worker process, and that steps too small to share run on one
(engine/worker/runner.py ``SMALL_STEP_FLOPS``)."""

from __future__ import annotations

import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.runtime.launcher import Launcher, worker_threads
from engine.worker.runner import SMALL_MODEL_BYTES, SMALL_STEP_FLOPS, ModelRunner
from tests.conftest_models import write_checkpoint


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("small"), "llama"))


def test_a_worker_gets_its_share_of_the_cores(small) -> None:
    assert worker_threads(EngineConfig(model=small), cpu_count=8) == 8
    assert worker_threads(EngineConfig(model=small), cpu_count=8, sharing=2) == 4
    assert worker_threads(EngineConfig(model=small), cpu_count=2, sharing=4) == 1
    assert worker_threads(EngineConfig(model=small, worker_threads=3), cpu_count=8) == 3


def test_the_users_omp_num_threads_wins(small, monkeypatch) -> None:
    launcher = Launcher(EngineConfig(model=small, worker_threads=2))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert launcher._worker_env(1)["OMP_NUM_THREADS"] == "2"
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        assert launcher._worker_env(1) is None  # the child inherits the user's 5
    finally:
        launcher.shutdown()


def test_worker_threads_must_be_positive(small) -> None:
    with pytest.raises(ValueError, match="--worker-threads must be at least 1"):
        EngineConfig(model=small, worker_threads=0).validate()


def test_small_steps_run_on_one_thread_large_ones_on_all(small) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runner = ModelRunner(EngineConfig(model=str(small), num_pages=2048, dtype="float32",
                                          device="cpu"))
        large_model = ModelRunner(EngineConfig(model=str(small), num_pages=64, dtype="float32",
                                               device="cpu"))
        large_model._small_model = False  # as if its weights were past SMALL_MODEL_BYTES
        per_token = 2 * runner.config.num_params
        num_seqs = int(SMALL_STEP_FLOPS // per_token) // 240 + 1  # 240-token prompts past it
        assert num_seqs * 240 * per_token >= SMALL_STEP_FLOPS and num_seqs * 15 <= 2048
        runner.forward(BatchInput.build([([0], 0, [1, 2, 3])], 16))
        assert torch.get_num_threads() == 1
        prompts = [(list(range(15 * i, 15 * i + 15)), 0, [5] * 240) for i in range(num_seqs)]
        runner.forward(BatchInput.build(prompts, 16))
        assert torch.get_num_threads() == 2
        runner.forward(BatchInput.build([([0], 0, [1])], 16))
        assert torch.get_num_threads() == 1
        # A model past SMALL_MODEL_BYTES keeps every thread: its steps are bandwidth-bound.
        assert runner.config.num_params * 4 < SMALL_MODEL_BYTES
        torch.set_num_threads(2)  # where its own worker process would be
        large_model.forward(BatchInput.build([([0], 0, [1])], 16))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
