"""Tensor parallel inside the model: which share of every weight a rank holds, and the three
places where ranks combine their partial results.

Rank ``r`` of ``N`` holds (Megatron-LM's split, as vLLM and SGLang do it)::

    qkv      column-parallel: its num_heads / N query heads and their KV heads (rows)
    o        row-parallel:    the same heads' columns      -> partial sums, all-reduced
    gate_up  column-parallel: intermediate / N rows each of gate and up
    down     row-parallel:    the same columns              -> partial sums, all-reduced
    embed    vocab-parallel:  rows [r * V', (r + 1) * V')   -> masked lookup, all-reduced
    lm_head  vocab-parallel:  the same rows                 -> logits gathered to rank 0
    norms    replicated

``V' = ceil(vocab / N)``: the last rank's rows past the vocabulary are zeros, and their logits
are cut off after the gather. Biases of row-parallel layers are added once, after the
all-reduce.

KV heads: with ``num_kv_heads >= N`` each rank holds ``num_kv_heads / N`` of them. With fewer
KV heads than ranks (and ``N`` a multiple of ``num_kv_heads``) each KV head is replicated on
``N / num_kv_heads`` ranks, each holding exactly the one its query heads read, as vLLM does.
Every rank's KV pool holds its own KV heads of the same page numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.worker.model.config import ModelConfig


class Collectives(Protocol):
    """What the model needs from the group of ranks (``engine.worker.distributed.TensorParallel``)."""

    rank: int
    size: int

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's [rows, V'] vocabulary shard: float32 [rows, vocab_size] on rank 0,
        None on the others."""


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a rank takes: ``[start, stop)`` along ``dim``, whose
    full length is ``full``."""

    dim: int
    start: int
    stop: int
    full: int


@dataclass(frozen=True)
class ShardPlan:
    """The sizes of rank ``rank``'s share of the model (the whole model when ``size`` is 1)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # the model's index of this rank's first KV head
    intermediate_size: int
    vocab_rows: int  # rows of embed / lm_head on this rank, padding included
    vocab_start: int
    vocab_stop: int  # end of this rank's real vocabulary rows

    @classmethod
    def for_rank(cls, c: ModelConfig, rank: int, size: int) -> ShardPlan:
        """Rank ``rank`` of ``size``'s share; a ValueError sentence when the model does not
        split that many ways."""
        if c.num_heads % size:
            raise ValueError(
                f"--tp-size {size} does not divide the model's {c.num_heads} attention heads; "
                f"choose a divisor of {c.num_heads}")
        if c.num_kv_heads >= size:
            if c.num_kv_heads % size:
                raise ValueError(
                    f"--tp-size {size} does not divide the model's {c.num_kv_heads} KV heads; "
                    f"choose a divisor of {c.num_kv_heads} (or a multiple of it that divides "
                    f"{c.num_heads})")
            num_kv, kv_start = c.num_kv_heads // size, rank * (c.num_kv_heads // size)
        else:
            if size % c.num_kv_heads:
                raise ValueError(
                    f"--tp-size {size} is more than the model's {c.num_kv_heads} KV heads but "
                    f"not a multiple of them, so they cannot be replicated evenly")
            num_kv, kv_start = 1, rank * c.num_kv_heads // size
        if c.intermediate_size % size:
            raise ValueError(
                f"--tp-size {size} does not divide the model's MLP width "
                f"({c.intermediate_size})")
        rows = -(-c.vocab_size // size)
        start = min(rank * rows, c.vocab_size)
        return cls(rank=rank, size=size, num_heads=c.num_heads // size, num_kv_heads=num_kv,
                   kv_head_start=kv_start, intermediate_size=c.intermediate_size // size,
                   vocab_rows=rows, vocab_start=start,
                   vocab_stop=min(start + rows, c.vocab_size))

    def layer_sources(self, prefix: str, c: ModelConfig) -> dict[str, Slice]:
        """Which slice of each of one decoder layer's checkpoint tensors this rank takes
        (replicated tensors are absent)."""
        d = c.head_dim
        q = Slice(0, self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d,
                  c.num_heads * d)
        kv = Slice(0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d,
                   c.num_kv_heads * d)
        inter = Slice(0, self.rank * self.intermediate_size,
                      (self.rank + 1) * self.intermediate_size, c.intermediate_size)
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        sources = {
            attn + "q_proj.weight": q, attn + "k_proj.weight": kv, attn + "v_proj.weight": kv,
            attn + "o_proj.weight": Slice(1, q.start, q.stop, q.full),
            mlp + "gate_proj.weight": inter, mlp + "up_proj.weight": inter,
            mlp + "down_proj.weight": Slice(1, inter.start, inter.stop, inter.full),
        }
        if c.qkv_bias:
            sources.update({attn + "q_proj.bias": q, attn + "k_proj.bias": kv,
                            attn + "v_proj.bias": kv})
        if c.mlp_bias:
            sources.update({mlp + "gate_proj.bias": inter, mlp + "up_proj.bias": inter})
        return sources

    def vocab_slice(self, c: ModelConfig) -> Slice:
        return Slice(0, self.vocab_start, self.vocab_stop, c.vocab_size)


def embed_vocab_parallel(input_ids: torch.Tensor, weight: torch.Tensor, plan: ShardPlan,
                         tp: Collectives) -> torch.Tensor:
    """Embedding rows of ``input_ids`` from the ranks' vocabulary shards: each rank looks up the
    ids it holds, zeros the others, and the sum over ranks has every row exactly once."""
    local = input_ids - plan.vocab_start
    elsewhere = (local < 0) | (local >= plan.vocab_stop - plan.vocab_start)
    rows = F.embedding(local.masked_fill(elsewhere, 0), weight)
    return tp.all_reduce_(rows.masked_fill_(elsewhere[:, None], 0))
