"""Tensor parallel (--tp-size): sharded weights and layers against the unsharded model, whole
sharded forwards with ranks as threads, and real gloo groups of processes against --tp-size 1
(prefix hits, chunked prefill, preemption, overlap placeholders, seeded sampling), refusals,
and a killed rank ending the group."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import Engine, SamplingParams
from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.step import BatchInput
from engine.worker.distributed import TensorParallel
from engine.worker.model.config import ModelConfig
from engine.worker.model.loader import load_model
from engine.worker.model.parallel import ShardPlan
from engine.worker.runner import ModelRunner
from tests.conftest_models import one_torch_thread, write_checkpoint
from tests.test_engine_e2e import check_killing_a_child_fails_generate
from tests.test_scheduler import Harness, shared_prefix_prompts

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_demo_model())


class ThreadGroup:
    """Ranks as threads of this process: each collective meets at a barrier, and every rank
    sums the parts in rank order (as gloo does, up to rounding)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody writes the next collective's part before all have read
        return parts


class ThreadRank(TensorParallel):
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        super().__init__(rank, group.size, torch.device("cpu"))
        self.group = group

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.rank, tensor.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return tensor.copy_(total)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        parts = self.group.exchange(self.rank, logits)
        return torch.cat(parts, -1)[:, :vocab_size].float() if self.rank == 0 else None

    def agree_min(self, value: int) -> int:
        return min(self.group.exchange(self.rank, value))

    def send_step(self, data: bytes) -> None:
        self.group.exchange(self.rank, data)

    def receive_step(self) -> bytes:
        return self.group.exchange(self.rank, None)[0]


def run_ranks(size: int, work) -> list:
    """``work(rank)`` on ``size`` threads joined in one ThreadGroup; their results by rank."""
    group, results, errors = ThreadGroup(size), [None] * size, []

    def target(rank: int) -> None:
        try:
            results[rank] = work(ThreadRank(group, rank))
        except BaseException as exc:  # a failed rank must not leave the others at a barrier
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_shard_plans_split_replicate_or_refuse(model_dir):
    c = ModelConfig.from_dir(model_dir)  # 8 heads, 4 KV heads, MLP 688
    two = [ShardPlan.for_rank(c, r, 2) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in two] == [(4, 2, 0), (4, 2, 2)]
    # More ranks than KV heads: each KV head lives on two ranks, the one its query heads read.
    eight = [ShardPlan.for_rank(c, r, 8) for r in range(8)]
    assert [p.kv_head_start for p in eight] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(p.num_heads == 1 and p.num_kv_heads == 1 for p in eight)
    with pytest.raises(ValueError, match="--tp-size 3 does not divide the model's 8 attention"):
        ShardPlan.for_rank(c, 0, 3)
    with pytest.raises(ValueError, match="--tp-size 16 does not divide"):
        ShardPlan.for_rank(c, 0, 16)


def test_flags_are_checked_before_anything_starts(model_dir):
    from engine.cli import build_parser
    from engine.commands.options import config_from_args

    args = build_parser().parse_args(["serve", "--model", model_dir, "--tp-size", "3"])
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        config_from_args(args)
    for options, message in [
        (dict(tp_size=4, nnodes=3), "--nnodes must divide --tp-size"),
        (dict(tp_size=2, nnodes=2), "needs --dist-init-addr"),
        (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank must be"),
        (dict(tp_size=2, dist_init_addr="10.0.0.1"), "HOST:PORT"),
        (dict(tp_size=2, dp_size=2), "not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=model_dir, **options).validate()


@pytest.mark.parametrize("size", [2, 8])
def test_sharded_linear_layers_equal_the_unsharded_ones(model_dir, size):
    c = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    full = load_model(model_dir, device=cpu, dtype=torch.float32)
    group = ThreadGroup(size)
    shards = [load_model(model_dir, device=cpu, dtype=torch.float32, tp=ThreadRank(group, r))
              for r in range(size)]
    x = torch.randn(5, c.hidden_size)
    whole, parts = full.layers[1], [s.layers[1] for s in shards]
    q, kv = whole.q_size, whole.kv_size
    # Column-parallel qkv: the ranks' query heads in order make up the model's; each rank's
    # K and V are its KV heads' (replicated at 8 ranks over 4 KV heads).
    out_q = torch.cat([F.linear(x, p.qkv[: p.q_size]) for p in parts], dim=1)
    torch.testing.assert_close(out_q, F.linear(x, whole.qkv[:q]))
    for p, shard in zip(parts, shards, strict=True):
        heads = slice(shard.plan.kv_head_start * c.head_dim,
                      (shard.plan.kv_head_start + p.num_kv_heads) * c.head_dim)
        torch.testing.assert_close(p.qkv[p.q_size : p.q_size + p.kv_size],
                                   whole.qkv[q : q + kv][heads])
        torch.testing.assert_close(p.qkv[p.q_size + p.kv_size :], whole.qkv[q + kv :][heads])
    # Row-parallel o and down: the ranks' partial products sum to the unsharded product.
    attn_out = torch.randn(5, q)
    o_parts = [F.linear(attn_out[:, r * p.q_size : (r + 1) * p.q_size], p.o)
               for r, p in enumerate(parts)]
    torch.testing.assert_close(sum(o_parts), F.linear(attn_out, whole.o), rtol=1e-5, atol=1e-5)

    def mlp(layer, rows):
        gate, up = F.linear(rows, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    torch.testing.assert_close(sum(mlp(p, x) for p in parts), mlp(whole, x), rtol=1e-5,
                               atol=1e-5)
    # Vocabulary-parallel lm_head: the shards side by side are the model's logits.
    logits = torch.cat([F.linear(x, s.lm_head) for s in shards], dim=1)[:, : c.vocab_size]
    torch.testing.assert_close(logits, F.linear(x, full.lm_head))


def two_steps(page_size: int, vocab: int) -> list[BatchInput]:
    """A prefill of two sequences, then a decode of one and an extend of the other over the
    pages of the first step (cached prefixes)."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, vocab, 7), rng.integers(3, vocab, 5)
    return [
        BatchInput.build([([3, 7], 0, a[:6]), ([1], 0, b[:3])], page_size, "all"),
        BatchInput.build([([3, 7], 6, a[6:]), ([1, 5], 3, b[3:])], page_size, "all"),
    ]


@pytest.mark.parametrize("kind, size", [("llama_bias", 4), ("qwen3", 4), ("qwen2", 2),
                                        ("llama", 2)])
def test_sharded_forward_equals_unsharded(tmp_path, kind, size):
    """Whole forwards, ranks as threads: biases (added once), tied embeddings and q/k norms,
    KV heads replicated (qwen3 at 4 ranks over 2 KV heads, qwen2 at 2 over 1), and a vocabulary
    of 90 that 4 ranks split with padding."""
    path = write_checkpoint(tmp_path / kind, kind, vocab_size=90)
    options = dict(page_size=4, num_pages=16, dtype="float32", attention_backend="torch")
    steps = two_steps(4, 90)
    unsharded = ModelRunner(EngineConfig(model=str(path), **options))
    expected = [unsharded.forward(step) for step in steps]

    def rank_work(tp: ThreadRank):
        runner = ModelRunner(EngineConfig(model=str(path), **options), tp)
        assert runner.pool.kv.shape[-2] == runner.model.plan.num_kv_heads
        return [runner.forward(step) for step in steps]

    results = run_ranks(size, rank_work)
    assert all(out is None for rank in results[1:] for out in rank)  # only rank 0 gets logits
    for got, want in zip(results[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.e2e
def test_tp2_over_gloo_gives_tp1_outputs_with_hits_chunks_and_preemption(model_dir):
    """Two processes over gloo against the in-process tp 1 worker, token for token in fp32:
    two waves over shared prefixes (the second hits the first's cache) in 24-token chunks,
    seeded sampling, then a pool of 16 pages that forces preemption (swap mode here, recompute
in the reference: outputs are the same either way). Overlap scheduling is on,
    so the decode steps carry placeholder ids that rank 0 resolves before broadcasting (rank 1
    refuses unresolved ones, which would end the group)."""
    prompts = shared_prefix_prompts(10, seed=2)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, n=2)
    options = dict(chunked_prefill_size=24, max_prefill_tokens=64)

    ref = Harness(model_dir, num_pages=256, **options)
    for i, p in enumerate(prompts[:4]):
        ref.add(f"a{i}", p, GREEDY)
    ref.run()
    for i, p in enumerate(prompts[4:]):
        ref.add(f"b{i}", p, GREEDY)
    ref.add("seeded", prompts[0], seeded)
    ref.run()
    small = Harness(model_dir, num_pages=16, chunked_prefill_size=64)
    for i, p in enumerate(prompts):
        small.add(f"p{i}", p, GREEDY)
    small.run()
    assert small.sched.num_preemptions > 0

    with Engine(model_dir, tp_size=2, num_pages=256, dtype="float32", **options) as tp:
        first = tp.generate(prompts[:4], GREEDY)
        second = tp.generate(prompts[4:], GREEDY)
        sampled = tp.generate(prompts[0], seeded)[0]
    assert [r.token_ids for r in first] == [ref.outputs[f"a{i}"][0] for i in range(4)]
    assert [r.token_ids for r in second] == [ref.outputs[f"b{i}"][0] for i in range(6)]
    assert sum(r.cached_tokens for r in second) > 0
    assert [o.token_ids for o in sampled.outputs] == [ref.outputs["seeded"][i] for i in range(2)]

    # Swap preemption here: each rank swaps its own KV heads of the same pages.
    with Engine(model_dir, tp_size=2, num_pages=16, chunked_prefill_size=64, dtype="float32",
                preemption_mode="swap", num_host_pages=64) as tp:
        results = tp.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == [small.outputs[f"p{i}"][0] for i in range(10)]


@pytest.mark.e2e
def test_killing_a_rank_fails_every_pending_request_at_once(model_dir):
    engine = Engine(model_dir, tp_size=2, num_pages=256, dtype="float32")
    check_killing_a_child_fails_generate(engine, "tp-rank-1", [[5 + i, 6, 7] for i in range(8)])


@pytest.mark.e2e
def test_two_nodes_on_one_machine(model_dir, tmp_path):
    """--nnodes 2 with both nodes on 127.0.0.1: node 1 is `radixserve serve --node-rank 1`,
    which runs only rank 1; node 0 runs the engine and rank 0. Outputs equal tp 1's, and node
    1 exits non-zero, saying why, once node 0's group is gone."""
    import subprocess
    import sys

    from tests.server_process import free_port

    prompts = shared_prefix_prompts(4, seed=4)
    ref = Harness(model_dir, num_pages=256)
    for i, p in enumerate(prompts):
        ref.add(str(i), p, GREEDY)
    ref.run()
    dist = dict(tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in dist.items()]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--dtype", "float32",
         "--num-pages", "256", "--port", str(free_port()), "--node-rank", "1", *flags],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        with Engine(model_dir, num_pages=256, dtype="float32", **dist) as node0:
            assert "tp-rank-1" not in node0.launcher.children
            results = node0.generate(prompts, GREEDY)
        _, stderr = node1.communicate(timeout=30)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert [r.token_ids for r in results] == [ref.outputs[str(i)][0] for i in range(4)]
    assert node1.returncode == 1
    assert "node 1's tensor-parallel ranks stopped" in stderr
