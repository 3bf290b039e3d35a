"""The tokenizer process's loop: the frontend's messages and the scheduler's outputs through a
``TokenizerWorker`` (tokenizer_worker/core.py); with ``--dp-size`` > 1 the loop of
tokenizer_worker/dp_process.py, which adds the dispatcher."""

from __future__ import annotations

import os

import zmq
from transformers import AutoTokenizer

from engine.contracts.engine_config import LaunchSpec
from engine.contracts.protocol import (
    AbortRequest,
    GenerateRequest,
    Ready,
    SessionClose,
    SessionOpen,
    Shutdown,
    TokenizedRequest,
    decode,
    encode,
)
from tokenizer_worker.core import TokenizerWorker


def run(spec: LaunchSpec, ctx: zmq.Context) -> None:
    ep, i = spec.endpoints, spec.index
    tokenizer = AutoTokenizer.from_pretrained(spec.config.model)
    tokenizer.model_max_length = 1 << 30  # the scheduler checks lengths against the context
    # The launcher resolved the context (--context-len, else the model's) into the config.
    worker = TokenizerWorker(tokenizer, i, context_len=spec.config.context_len,
                             special_in_content=spec.config.allow_special_tokens_in_content)
    if spec.config.dp_size > 1:  # replicas behind a cache-aware dispatcher
        from tokenizer_worker import dp_process
        return dp_process.run(spec, ctx, worker)
    from_frontend = ctx.socket(zmq.PULL)
    from_frontend.bind(ep.tokenizer_in[i])
    from_scheduler = ctx.socket(zmq.PULL)
    from_scheduler.bind(ep.tokenizer_from_scheduler[i])
    to_scheduler = ctx.socket(zmq.PUSH)
    to_scheduler.connect(ep.scheduler_in)
    to_frontend = ctx.socket(zmq.PUSH)
    to_frontend.connect(ep.frontend_in)
    control = ctx.socket(zmq.PUSH)
    control.connect(ep.control)
    control.send(encode(Ready(f"tokenizer-{i}", os.getpid())))

    poller = zmq.Poller()
    poller.register(from_frontend, zmq.POLLIN)
    poller.register(from_scheduler, zmq.POLLIN)
    while True:
        events = dict(poller.poll())
        if from_scheduler in events:
            msg = decode(from_scheduler.recv())
            if msg.stats is not None:
                to_frontend.send(encode(msg.stats))
            outputs, aborts = worker.on_outputs(msg)
            for abort in aborts:
                to_scheduler.send(encode(abort))
            for out in outputs:
                to_frontend.send(encode(out))
        if from_frontend in events:
            msg = decode(from_frontend.recv())
            if isinstance(msg, GenerateRequest):
                reply = worker.on_request(msg)
                sock = to_scheduler if isinstance(reply, TokenizedRequest) else to_frontend
                sock.send(encode(reply))
            elif isinstance(msg, AbortRequest):
                worker.on_abort(msg)
                to_scheduler.send(encode(msg))
            elif isinstance(msg, SessionOpen | SessionClose):
                worker.on_session(msg)
                to_scheduler.send(encode(msg))
            elif isinstance(msg, Shutdown):
                return
