"""``--deterministic``: a row's logits are the same bits whether its prefix came from the cache
(device pool, host tier, disk tier after a restart) or was computed, whatever the chunk size,
the page size, the rows beside it in a step and speculation; greedy and seeded tokens follow.

Runs through the scheduler and the worker in one process (tests/test_scheduler.py's
``Harness``) on tests/conftest.py's ``default_model``: Q4_1 blocks read by the compiled
kernels, in the machine's default dtype (the default configuration) and in float32, and with
the weights widened (``--quantization none``, dense products) in float32 and the default dtype.
Every logits row of one prompt's 24 greedy tokens is compared with its cold run alone, bit for
bit. The attention kernel's own rows (prefill, verify and decode rows, windows, int8 pages) are
checked below: each of its rows equals a decode of that token alone."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
import torch

from engine.checkpoints.gguf import gguf_checkpoint
from engine.contracts.engine_config import EngineConfig
from engine.contracts.sampling_params import SamplingParams
from engine.worker.model.llama import can_prepack
from engine.worker.model.row_tiles import in_row_tiles
from tests.test_cpu_kernels import VARIANTS, load_variants, random_case
from tests.test_host_cache import host_cache_gb
from tests.test_kv_int8_kernels import int8_case
from tests.test_scheduler import Harness

PROMPT = random.Random(1).choices(range(256), k=100)
TOKENS = 24
# Model options: the default configuration, float32, dense weights, an int8 KV pool.
CONFIGS = {
    "default": {},
    "float32": {"dtype": "float32"},
    "dense-float32": {"dtype": "float32", "quantization": "none"},
    "dense-default": {"quantization": "none"},
    "int8-kv": {"kv_cache_dtype": "int8"},
}


def ids(seed: int, length: int, vocab: range = range(256)) -> list[int]:
    return random.Random(seed).choices(vocab, k=length)


def params(seed: int, tokens: int = TOKENS, **fields) -> SamplingParams:
    """Greedy unless asked; ``seed`` also names the request's logits rows (greedy rows draw
    nothing, so it changes no token)."""
    fields = {"temperature": 0.0, **fields}
    return SamplingParams(max_tokens=tokens, ignore_eos=True, seed=seed, **fields)


class LogitsHarness(Harness):
    """A Harness that keeps every sampled logits row, by (the request's seed, its output
    length then): the row a request's token at that position was drawn from."""

    def __init__(self, model: str, **options) -> None:
        options = {"dtype": None, "quantization": "auto", "overlap_schedule": "off",
                   "deterministic": True, **options}
        super().__init__(model, **options)
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        forward = self.worker._forward

        def recording(msg, step):
            logits = forward(msg, step)
            for row, sampling in enumerate(msg.sampling):
                self.logits[(sampling.params.seed, sampling.output_len)] = logits[row].clone()
            return logits

        self.worker._forward = recording

    def rows(self, seed: int) -> list[tuple[int, torch.Tensor]]:
        return sorted((length, row) for (s, length), row in self.logits.items() if s == seed)


@pytest.fixture(scope="module")
def model(default_model) -> str:
    return str(gguf_checkpoint(default_model))


_cold: dict[str, LogitsHarness] = {}


def cold(model: str, config: str, **options) -> LogitsHarness:
    """The prompt alone, computed from nothing (once per configuration)."""
    key = config + json.dumps(options, sort_keys=True)
    if key not in _cold:
        h = LogitsHarness(model, **CONFIGS[config], **options)
        h.add("r1", PROMPT, params(1))
        h.run()
        _cold[key] = h
    return _cold[key]


def assert_same(reference: LogitsHarness, h: LogitsHarness, seed: int = 1) -> None:
    """Every logits row of ``h``'s request ``r{seed}`` is the same bits as the reference's r1."""
    want, got = reference.rows(1), h.rows(seed)
    assert [length for length, _ in got] == list(range(TOKENS))
    for (length, a), (_, b) in zip(want, got, strict=True):
        assert torch.equal(a, b), (f"logits row {length} differs by up to "
                                   f"{float((a - b).abs().max()):.3g}")
    assert h.outputs[f"r{seed}"][0] == reference.outputs["r1"][0]


def resend(h: LogitsHarness, prompt: list[int] = PROMPT) -> None:
    h.add("r0", prompt, params(0))
    h.run()
    h.add("r1", prompt, params(1))
    h.run()
    assert h.finals["r1"][0].cached_tokens == len(prompt) - 1


def cached_at(split: int, prompt: list[int] = PROMPT) -> Callable[[LogitsHarness], None]:
    """The prompt's first ``split`` tokens served first: the prompt then extends them."""
    def scenario(h: LogitsHarness) -> None:
        h.add("r0", prompt[:split], params(0, 1))
        h.run()
        h.add("r1", prompt, params(1))
        h.run()
        assert h.finals["r1"][0].cached_tokens == split
    return scenario


def in_batch(others: int, prompt: list[int] = PROMPT,
             vocab: range = range(256)) -> Callable[[LogitsHarness], None]:
    """The prompt joins ``others`` requests two steps in: its prefill beside their decodes and
    prefill chunks, then its decodes beside theirs (rows of 1 to 16 others)."""
    def scenario(h: LogitsHarness) -> None:
        for i in range(others):
            h.add(f"o{i}", ids(100 + i, 20 + 13 * i, vocab), params(100 + i, 40))
        h.step()
        h.step()
        h.add("r1", prompt, params(1))
        h.run()
    return scenario


SCENARIOS = {
    "resent": resend,
    "cached inside a page": cached_at(7),
    "cached at a page edge": cached_at(16),
    "cached at a later edge": cached_at(64),
    "cached inside a later page": cached_at(41),
    "beside 1": in_batch(1),
    "beside 4": in_batch(4),
    "beside 16": in_batch(16),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_cached_or_batched_prompt_gives_its_cold_logits(model, config, scenario):
    h = LogitsHarness(model, **CONFIGS[config])
    SCENARIOS[scenario](h)
    assert_same(cold(model, config), h)


STEP_SHAPES = {
    "chunks of 8": {"chunked_prefill_size": 8},
    "chunks of 24": {"chunked_prefill_size": 24},
    "chunks of 50": {"chunked_prefill_size": 50},
    "pages of 1": {"page_size": 1, "num_pages": 4096},
    "pages of 4": {"page_size": 4, "num_pages": 1024},
    "speculation": {"speculative_config": json.dumps({
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})},
}


@pytest.mark.parametrize("config", ["default", "float32", "dense-float32"])
@pytest.mark.parametrize("shape", STEP_SHAPES)
def test_chunks_pages_and_speculation_change_no_logits(model, config, shape):
    h = LogitsHarness(model, **CONFIGS[config], **STEP_SHAPES[shape])
    h.add("r1", PROMPT, params(1))
    h.run()
    if shape != "speculation":
        assert_same(cold(model, config), h)
        return
    # Verify steps ran: a sequence's drafts take several rows of one step, each sampled under
    # the position it predicts. A row after a rejected draft is computed again in a later
    # step (the last write of each position is what the emitted token came from).
    assert h.sched.speculator.drafted_tokens > 0
    reference = cold(model, config)
    assert h.outputs["r1"][0] == reference.outputs["r1"][0]
    want = dict(reference.rows(1))
    for length, row in h.rows(1):
        if length < TOKENS:
            assert torch.equal(row, want[length]), f"logits row {length} differs"


@pytest.mark.parametrize("config", ["default", "float32"])
def test_a_prefix_from_the_host_tier_gives_its_cold_logits(model, config):
    """A device pool too small for two prompts: the first prompt's pages move to the host tier
    while others run, and come back from there."""
    h = LogitsHarness(model, **CONFIGS[config], num_pages=10,
                      host_cache_gb=host_cache_gb(model, 64, 16))
    h.add("r0", PROMPT, params(0))
    h.run()
    for i in range(3):
        h.add(f"o{i}", ids(200 + i, 120), params(200 + i, 8))
        h.run()
    h.add("r1", PROMPT, params(1))
    h.run()
    assert h.finals["r1"][0].cached_tokens_host > 0
    assert_same(cold(model, config), h)


@pytest.mark.parametrize("config", ["default", "float32"])
def test_a_prefix_from_the_disk_tier_after_a_restart_gives_its_cold_logits(model, config,
                                                                             tmp_path):
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    first = LogitsHarness(model, **CONFIGS[config], disk_cache_dir=str(directory))
    first.add("r0", PROMPT, params(0))
    first.run()
    first.worker.io.close()  # what a stopping server does: write what is queued
    restarted = LogitsHarness(model, **CONFIGS[config], disk_cache_dir=str(directory))
    restarted.add("r1", PROMPT, params(1))
    restarted.run()
    assert restarted.finals["r1"][0].cached_tokens_disk == len(PROMPT) // 16 * 16
    assert_same(cold(model, config), restarted)


def test_seeded_sampling_is_the_same_cached_and_batched(model):
    sampled = params(7, temperature=0.9)
    alone = LogitsHarness(model)
    alone.add("r7", PROMPT, sampled)
    alone.run()
    crowded = LogitsHarness(model, chunked_prefill_size=24)
    crowded.add("r0", PROMPT[:40], params(0, 1))
    crowded.run()
    for i in range(6):
        crowded.add(f"o{i}", ids(300 + i, 30 + 9 * i), params(300 + i, 30, temperature=0.9))
    crowded.step()
    crowded.add("r7", PROMPT, sampled)
    crowded.run()
    assert crowded.outputs["r7"][0] == alone.outputs["r7"][0]
    assert len(set(alone.outputs["r7"][0])) > 3  # sampled, not a constant


def test_the_fast_path_is_what_the_flag_changes(model):
    """Without the flag a cached prefix may change the bits (prefill runs SDPA, decode the
    kernel): the matrix above measures the flag, not a model too small to differ."""
    fast = LogitsHarness(model, deterministic=False)
    resend(fast)
    reference = LogitsHarness(model, deterministic=False)
    reference.add("r1", PROMPT, params(1))
    reference.run()
    assert any(not torch.equal(a, b) for (_, a), (_, b)
               in zip(reference.rows(1), fast.rows(1), strict=True))


@pytest.mark.parametrize("given", [{"device": "cuda"}, {"attention_backend": "flashinfer"},
                                   {"kv_cache_dtype": "fp8_e4m3"}, {"tp_size": 2},
                                   {"linear_form": "widened"}, {"linear_form": "resident"}])
def test_combinations_it_cannot_keep_are_refused(given):
    with pytest.raises(ValueError, match="--deterministic runs on the compiled CPU kernels"):
        EngineConfig(model="demo", deterministic=True, **given).validate()


def test_sglangs_flag_name_sets_it():
    from engine.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-deterministic-inference"])
    assert args.deterministic
    assert not build_parser().parse_args(["serve"]).deterministic


@pytest.fixture(scope="module")
def variants() -> dict[str, object]:
    return load_variants()


# Sequences adding: a 70-row prefill chunk over 100 keys (three tiles of rows), a chunk after a
# cached prefix, verifies, decodes; on and around page and 16-key block edges.
KERNEL_SEQ_LENS = [100, 70, 33, 17, 16, 40, 1]
KERNEL_ROWS = [70, 37, 9, 1, 16, 3, 1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pages", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,starts", [(0, False), (5, False), (0, True)])
def test_every_kernel_row_is_the_decode_of_its_token(variants, variant, pages, page_size,
                                                     window, starts):
    """The attention kernel's rows in any step, prefill rows included, with a sliding window
    or a start (the cascade's own part): each row's output and log-sum-exp are those of a
    one-row decode of its token (its sequence cut after it), bit for bit, whatever the page
    size, the tile it fell in and the rows beside it."""
    dtype = torch.float32 if pages == "float32" else torch.bfloat16
    heads, kv_heads, head_dim = 9, 3, 64
    make = int8_case if pages == "int8" else random_case
    _, k_pages, v_pages, indptr, indices, seq_lens = make(heads, kv_heads, head_dim, page_size,
                                                          KERNEL_SEQ_LENS, dtype)
    q_indptr = torch.tensor([0, *torch.tensor(KERNEL_ROWS).cumsum(0).tolist()],
                            dtype=torch.int32)
    q = torch.randn(sum(KERNEL_ROWS), heads, head_dim,
                    generator=torch.Generator().manual_seed(3)).to(dtype)
    begin = (torch.tensor([n - r for n, r in zip(KERNEL_SEQ_LENS, KERNEL_ROWS, strict=True)],
                          dtype=torch.int32) // 2 if starts else None)
    op = variants[variant].paged_decode
    got, lse = op(q, k_pages, v_pages, indptr, indices, seq_lens, window, 0.125, begin,
                  q_indptr)
    for b, count in enumerate(KERNEL_ROWS):
        for j in range(count):
            row = int(q_indptr[b]) + j
            length = int(seq_lens[b]) - count + j + 1
            first = int(indptr[b])
            own = indices[first: first + -(-length // page_size)].contiguous()
            one, one_lse = op(q[row: row + 1].contiguous(), k_pages, v_pages,
                              torch.tensor([0, len(own)], dtype=torch.int32), own,
                              torch.tensor([length], dtype=torch.int32), window, 0.125,
                              None if begin is None else begin[b: b + 1].contiguous())
            assert torch.equal(got[row], one[0]) and torch.equal(lse[row], one_lse[0]), (b, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_products_in_fixed_tiles_give_a_row_the_same_bits_in_any_call(dtype):
    """What ``pin_row_order`` relies on: oneDNN's and MKL's products change a row's sums with
    the row count, not with the row's place in a call of one shape, nor with the threads."""
    weight = torch.randn(1728, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    x = torch.randn(50, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    products = [lambda rows: torch.nn.functional.linear(rows, weight)]
    if dtype == torch.bfloat16 and can_prepack(torch.device("cpu"), dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        products.append(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None,
                                                                        "none", [], ""))
    before = torch.get_num_threads()
    try:
        for product in products:
            alone = torch.cat([in_row_tiles(product, x[i: i + 1])
                               for i in range(len(x))])
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for start in (0, 3, 17):
                    together = in_row_tiles(product, x[start:])
                    assert torch.equal(together, alone[start:]), (threads, start)
    finally:
        torch.set_num_threads(before)
