"""One device sync per step: a step's forward waits for nothing, the sampler's one copy back
waits once.

On CUDA a host-to-device copy from pageable memory (``tensor.to(device)`` without
``non_blocking``) makes the host wait for all work queued before it, as do ``.cpu()``,
``.item()`` and ``.tolist()`` of a device tensor. On CPU nothing is copied, but the calls are
the same, so a spy counting them where the runner plans and runs a step counts the syncs that
step would make on a GPU. The steps here are the ones that used to make extra ones: a
copy-on-write step (the pool's slot indices) and a cascade step on the torch backend (each
plan's tables and masks); the torch backend's GPU path (no compiled CPU kernel) is forced.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.step import BatchInput
from engine.worker.runner import ModelRunner
from engine.worker.sampler import RowState, sample
from engine.worker.staging import to_device
from tests.conftest_models import one_torch_thread, write_checkpoint

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

PAGE = 4


class BlockingCopySpy:
    """Counts the tensor calls that wait for the device on CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        to, cpu, item, tolist = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.item,
                                 torch.Tensor.tolist)
        spy = self

        def counted_to(tensor, *args, **kwargs):
            moves = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
            if moves and not kwargs.get("non_blocking", False):
                spy.calls.append("to(device)")
            return to(tensor, *args, **kwargs)

        def counting(name, method):
            def wrapper(tensor, *args, **kwargs):
                spy.calls.append(name)
                return method(tensor, *args, **kwargs)
            return wrapper

        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        monkeypatch.setattr(torch.Tensor, "cpu", counting("cpu()", cpu))
        monkeypatch.setattr(torch.Tensor, "item", counting("item()", item))
        monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist()", tolist))

    def count_during(self, fn) -> tuple[int, object]:
        self.calls.clear()
        result = fn()
        return len(self.calls), result


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    runner = ModelRunner(EngineConfig(model=str(path), page_size=PAGE, num_pages=64,
                                      dtype="float32", device="cpu", attention_backend="torch"))
    runner.attention._paged_decode = None  # the torch backend's path on a GPU
    runner.attention._rope_store = None
    return runner


def greedy_rows(count: int) -> list[RowState]:
    none = np.zeros(0, dtype=np.int32)
    return [RowState(SamplingParams(temperature=0.0), none, none) for _ in range(count)]


def test_the_spy_sees_a_blocking_copy(monkeypatch) -> None:
    spy = BlockingCopySpy(monkeypatch)
    cpu = torch.device("cpu")
    assert spy.count_during(lambda: torch.from_numpy(np.arange(3)).to(cpu))[0] == 1
    assert spy.count_during(lambda: to_device(np.arange(3), cpu))[0] == 0


def test_a_copy_on_write_step_waits_only_in_the_sampler(runner, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    runner.forward(BatchInput.build([([0, 1, 2], 0, rng.integers(3, 90, 10))], PAGE))
    # A new sequence matched 6 tokens: page 0 shared, page 1's first 2 slots copied to page 5.
    step = BatchInput.build([([0, 5, 6], 6, rng.integers(3, 90, 3))], PAGE,
                            copies=[(1, 5, 2)])
    spy = BlockingCopySpy(monkeypatch)
    syncs, logits = spy.count_during(lambda: runner.forward(step))
    assert syncs == 0, spy.calls
    assert spy.count_during(lambda: sample(logits, greedy_rows(1)))[0] == 1  # the copy back
    assert torch.equal(runner.pool.kv[:, :, 5, :2], runner.pool.kv[:, :, 1, :2])


def test_a_cascade_step_waits_only_in_the_sampler(runner, monkeypatch) -> None:
    rng = np.random.default_rng(1)
    shared = [10, 11, 12, 13, 14, 15]  # six pages of a common prefix
    runner.forward(BatchInput.build([(shared, 0, rng.integers(3, 90, 24))], PAGE))
    seqs = [(shared + [20 + 2 * i, 21 + 2 * i], 24, rng.integers(3, 90, 3 + i))
            for i in range(3)]
    runner.forward(BatchInput.build(seqs, PAGE))
    decode = BatchInput.build([(pages, 27 + i, [7]) for i, (pages, _, _) in enumerate(seqs)],
                              PAGE)
    spy = BlockingCopySpy(monkeypatch)
    syncs, logits = spy.count_during(lambda: runner.forward(decode))
    assert any(g.cascade is not None for g in runner.attention._groups)  # it took the cascade
    assert syncs == 0, spy.calls
    assert spy.count_during(lambda: sample(logits, greedy_rows(3)))[0] == 1
