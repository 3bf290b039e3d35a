"""ModelRunner against transformers (the oracle) and against itself under every paging trick.

fp32 on CPU. Pages are handed out in shuffled order so that nothing relies on a sequence's pages
being contiguous.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.runner import ModelRunner
from tests.conftest_models import KINDS, load_reference, one_torch_thread, write_checkpoint

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

NUM_SLOTS = 2048  # per runner, whatever the page size
VOCAB = 96
TOL = 1e-4


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: write_checkpoint(root / kind, kind) for kind in KINDS}


@functools.cache
def reference(path: Path) -> torch.nn.Module:
    return load_reference(path)


def make_runner(path: Path, page_size: int, **kwargs) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), page_size=page_size,
                                    num_pages=NUM_SLOTS // page_size,
                                    **{"dtype": "float32", **kwargs}))


class Pages:
    """Hands out distinct page numbers in random order (a stand-in for the scheduler)."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.free = list(np.random.default_rng(seed).permutation(runner.num_pages))
        self.page_size = runner.page_size

    def take(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.page_size)
        taken, self.free = self.free[:count], self.free[count:]
        return [int(p) for p in taken]


def tokens(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n).astype(np.int32)


def hf_logits(path: Path, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return reference(path)(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]


def prefill(
    runner: ModelRunner, pages: list[int], ids: np.ndarray, cached: int = 0
) -> torch.Tensor:
    return runner.forward(
        BatchInput.build([(pages, cached, ids[cached:])], runner.page_size, "all")
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_decode_matches_transformers(checkpoints, kind: str, page_size: int) -> None:
    """Prefill a prompt, then 16 greedy steps: each step's logits equal transformers' logits for
    the same prefix (teacher forcing), and every greedy token is transformers' argmax."""
    path = checkpoints[kind]
    runner = make_runner(path, page_size)
    prompt, steps = tokens(11), 16
    pages = Pages(runner).take(len(prompt) + steps)
    seq = list(prompt)
    step_logits = [prefill(runner, pages, prompt)[-1]]
    for _ in range(steps):
        seq.append(int(step_logits[-1].argmax()))
        batch = BatchInput.build([(pages, len(seq) - 1, [seq[-1]])], page_size)
        step_logits.append(runner.forward(batch)[0])
    ours = torch.stack(step_logits)
    expected = hf_logits(path, np.array(seq, dtype=np.int32))[len(prompt) - 1 :]
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)
    assert expected[:-1].argmax(-1).tolist() == seq[len(prompt) :]


@pytest.mark.parametrize(("page_size", "cached"), [(1, 21), (16, 21), (16, 32)])
def test_prefill_over_cached_prefix_equals_full_prefill(checkpoints, page_size, cached) -> None:
    """Sequence B reuses A's first `cached` tokens through its page table; a match that ends
    inside a page copies that page's head into a fresh page first (copy-on-write). B's logits
    equal a full prefill, and A's pages are left intact for A's own decode."""
    path = checkpoints["qwen3"]
    runner = make_runner(path, page_size)
    alloc = Pages(runner)
    ids = tokens(40)
    pages_a = alloc.take(cached + 4)  # room for A to decode one more token
    prefill(runner, pages_a, ids[: cached + 3])

    full_pages = cached // page_size
    copies = []
    pages_b = pages_a[:full_pages]
    if cached % page_size:
        fresh = alloc.take(1)[0]
        copies.append((pages_a[full_pages], fresh, cached % page_size))
        pages_b = pages_b + [fresh]
    pages_b = pages_b + alloc.take(len(ids) - len(pages_b) * page_size)
    batch = BatchInput.build([(pages_b, cached, ids[cached:])], page_size, "all", copies=copies)
    got = runner.forward(batch)

    expected = prefill(runner, alloc.take(len(ids)), ids)[cached:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, hf_logits(path, ids)[cached:], atol=TOL, rtol=0)

    # A continues on its own pages: B's writes must not have touched them.
    a_next = BatchInput.build([(pages_a, cached + 3, [5])], page_size)
    a_ids = np.concatenate([ids[: cached + 3], [5]]).astype(np.int32)
    torch.testing.assert_close(
        runner.forward(a_next)[0], hf_logits(path, a_ids)[-1], atol=TOL, rtol=0
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_equals_one_shot(checkpoints, page_size: int) -> None:
    runner = make_runner(checkpoints["llama"], page_size)
    alloc = Pages(runner)
    ids = tokens(40)
    pages = alloc.take(len(ids))
    chunks = [
        runner.forward(BatchInput.build([(pages, start, ids[start:end])], page_size, "all"))
        for start, end in [(0, 5), (5, 21), (21, 40)]
    ]
    one_shot = prefill(runner, alloc.take(len(ids)), ids)
    torch.testing.assert_close(torch.cat(chunks), one_shot, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_mixed_batch_equals_each_sequence_alone(checkpoints, kind: str, page_size: int) -> None:
    """Extends, a fresh prefill and decodes of different lengths in one forward give each
    sequence the logits it gets alone (mistral adds a sliding window to the masks, gemma3 a
    window on one layer of two)."""
    runner = make_runner(checkpoints[kind], page_size)
    alloc = Pages(runner)
    # (cached tokens, new tokens)
    shapes = [(9, 7), (12, 1), (0, 20), (30, 1), (3, 1)]
    seqs = []
    for i, (cached, new) in enumerate(shapes):
        ids = tokens(cached + new, seed=10 + i)
        pages = alloc.take(cached + new)
        if cached:
            prefill(runner, pages, ids[:cached])
        seqs.append((pages, cached, ids[cached:]))
    together = runner.forward(BatchInput.build(seqs, page_size, "all"))
    alone = torch.cat([runner.forward(BatchInput.build([s], page_size, "all")) for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)

    decodes = [s for s in seqs if len(s[2]) == 1]
    together = runner.forward(BatchInput.build(decodes, page_size))
    alone = torch.cat([runner.forward(BatchInput.build([s], page_size)) for s in decodes])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_swap_out_and_back_in_to_other_pages(checkpoints, page_size: int) -> None:
    """Swap a sequence's pages to the host, let another sequence overwrite them in the same step
    (swaps run before the forward), swap back into different pages, and decode."""
    path = checkpoints["llama"]
    runner = make_runner(path, page_size, num_host_pages=64)
    alloc = Pages(runner)
    ids = tokens(21)
    pages = alloc.take(len(ids) + 1)
    prefill(runner, pages, ids)

    host = list(range(len(pages)))
    other = tokens(len(pages) * page_size, seed=7)
    runner.forward(
        BatchInput.build(
            [(pages, 0, other)], page_size, swap_out=list(zip(pages, host, strict=True))
        )
    )
    new_pages = alloc.take(len(ids) + 1)
    batch = BatchInput.build(
        [(new_pages, len(ids), [9])], page_size, swap_in=list(zip(host, new_pages, strict=True))
    )
    expected = hf_logits(path, np.concatenate([ids, [9]]).astype(np.int32))[-1]
    torch.testing.assert_close(runner.forward(batch)[0], expected, atol=TOL, rtol=0)


def test_logits_rows_select_any_tokens(checkpoints) -> None:
    runner = make_runner(checkpoints["qwen2"], 16)
    ids = tokens(12)
    batch = BatchInput.build([(Pages(runner).take(12), 0, ids)], 16)
    batch.logits_rows = np.array([0, 5, 11], dtype=np.int32)
    torch.testing.assert_close(
        runner.forward(batch), hf_logits(checkpoints["qwen2"], ids)[[0, 5, 11]], atol=TOL, rtol=0
    )


def test_runner_refuses_sequences_past_the_context(checkpoints) -> None:
    runner = make_runner(checkpoints["llama"], 16)
    batch = BatchInput.build([(Pages(runner).take(257), 256, [5])], 16)  # context is 256
    with pytest.raises(ValueError, match="reaches 257 tokens but the model's context is 256"):
        runner.forward(batch)
