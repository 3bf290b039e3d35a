"""Tensor-parallel ranks 1..N-1: each runs the forward of every step rank 0 sends it, over its
share of the model and its KV heads of the same pages, and answers nothing (rank 0 samples).
Runtime LoRA loads and unloads come the same way, between the steps, and each rank reads its
share of the adapter's files itself (at start too: ``--lora-modules``).

Any failure here ends the process, and with it the group: a rank that missed a step can never
catch up (its KV pages would lack that step's tokens), and its peers would wait for it in the
next collective. The one exception is an adapter's load, which every rank then drops together.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import zmq

from engine.contracts.engine_config import LaunchSpec
from engine.contracts.protocol import LoraUpdate, Ready, Shutdown, decode, encode
from engine.contracts.worker_messages import ForwardBatch
from engine.worker.distributed import TensorParallel, start_tensor_parallel
from engine.worker.process import make_runner, prefault_pool

if TYPE_CHECKING:
    from engine.worker.runner import ModelRunner

logger = logging.getLogger("radixserve.tp_worker")


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    rank = spec.index
    tp = start_tensor_parallel(spec.config, rank)
    runner = make_runner(spec.config, tp)
    prefault_pool(runner)
    control = ctx.socket(zmq.PUSH)
    control.connect(spec.endpoints.control)
    control.send(encode(Ready(f"tp-rank-{rank}", os.getpid())))
    follow(runner, tp)


def follow(runner: ModelRunner, tp: TensorParallel) -> None:
    """Run what rank 0 sends, in its order (steps and adapter updates), until its Shutdown."""
    while True:
        msg = decode(tp.receive_step())
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, LoraUpdate):
            _update_lora(runner, tp, msg)
            continue
        if not isinstance(msg, ForwardBatch):
            raise TypeError(f"rank {tp.rank} got a {type(msg).__name__} from rank 0")
        if (msg.step.input_ids < 0).any():
            # Rank 0 resolves the placeholders of overlap scheduling before it broadcasts.
            raise ValueError(f"rank {tp.rank} got placeholder input ids in batch {msg.batch_id}")
        runner.forward(msg.step, checked=True)


def _update_lora(runner: ModelRunner, tp: TensorParallel, msg: LoraUpdate) -> None:
    """Rank 0's adapter unload, or its load (which it has done already) of this rank's share.
    A load that fails here, or reads other files than rank 0 did (rewritten in between), is
    dropped by every rank: ``agree_min`` tells them all (rank 0 answers with the failure), and
    no step names the adapter."""
    if msg.path is None:
        runner.lora.remove(msg.lora_id)
        return
    try:
        loaded = runner.load_lora(msg.lora_id, msg.name, msg.path).content_hash
        same = loaded == msg.content_hash
        if not same:
            logger.warning("rank %d read LoRA adapter %r at %s with content hash %s but rank 0 "
                           "read %s: its files changed in between", tp.rank, msg.name, msg.path,
                           loaded, msg.content_hash)
    except Exception as exc:  # a failed load fails on every rank, never the group
        logger.warning("rank %d could not load LoRA adapter %r from %s: %s", tp.rank, msg.name,
                       msg.path, exc)
        same = False
    if not tp.agree_min(int(same)):
        runner.lora.remove(msg.lora_id)
