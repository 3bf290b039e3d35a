"""How many OpenMP threads a model worker gets (engine/launcher.py ``worker_threads``), and that
the launcher hands it to the worker process."""

from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.launcher import SMALL_MODEL_PARAMS, Launcher, worker_threads
from engine.model.config import ModelConfig
from tests.conftest_models import write_checkpoint


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("small"), "llama"))


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> str:
    # Only config.json is read: a 30M+ parameter shape without writing its weights.
    path = write_checkpoint(tmp_path_factory.mktemp("large"), "llama")
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=2048, intermediate_size=8192)
    (path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(path).num_params >= SMALL_MODEL_PARAMS
    return str(path)


def test_a_small_model_gets_one_thread_a_large_one_its_share(small, large) -> None:
    assert ModelConfig.from_dir(small).num_params < SMALL_MODEL_PARAMS
    assert worker_threads(EngineConfig(model=small), cpu_count=8) == 1
    assert worker_threads(EngineConfig(model=large), cpu_count=8) == 8
    assert worker_threads(EngineConfig(model=large), cpu_count=8, sharing=2) == 4
    assert worker_threads(EngineConfig(model=large), cpu_count=2, sharing=4) == 1
    assert worker_threads(EngineConfig(model=small, worker_threads=3), cpu_count=8) == 3


def test_the_users_omp_num_threads_wins(small, monkeypatch) -> None:
    launcher = Launcher(EngineConfig(model=small))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert launcher._worker_env(1)["OMP_NUM_THREADS"] == "1"
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        assert launcher._worker_env(1) is None  # the child inherits the user's 5
    finally:
        launcher.shutdown()


def test_worker_threads_must_be_positive(small) -> None:
    with pytest.raises(ValueError, match="--worker-threads must be at least 1"):
        EngineConfig(model=small, worker_threads=0).validate()
