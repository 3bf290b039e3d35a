"""Tensor-parallel ranks 1..N-1: each runs the forward of every step rank 0 sends it, over its
share of the model and its KV heads of the same pages, and answers nothing (rank 0 samples).

Any failure here ends the process, and with it the group: a rank that missed a step can never
catch up (its KV pages would lack that step's tokens), and its peers would wait for it in the
next collective.
"""

from __future__ import annotations

import logging
import os

import zmq

from engine.contracts.engine_config import LaunchSpec
from engine.contracts.protocol import ForwardBatch, Ready, Shutdown, decode, encode
from engine.worker.distributed import start_tensor_parallel
from engine.worker.process import make_runner

logger = logging.getLogger("radixserve.tp_worker")


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    rank = spec.index
    tp = start_tensor_parallel(spec.config, rank)
    runner = make_runner(spec.config, tp)
    control = ctx.socket(zmq.PUSH)
    control.connect(spec.endpoints.control)
    control.send(encode(Ready(f"tp-rank-{rank}", os.getpid())))
    while True:
        msg = decode(tp.receive_step())
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, ForwardBatch):
            raise TypeError(f"rank {rank} got a {type(msg).__name__} from rank 0")
        if (msg.step.input_ids < 0).any():
            # Rank 0 resolves the placeholders of overlap scheduling before it broadcasts.
            raise ValueError(f"rank {rank} got placeholder input ids in batch {msg.batch_id}")
        runner.forward(msg.step, checked=True)
