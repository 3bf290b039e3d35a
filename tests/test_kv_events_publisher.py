"""KV cache events on the wire (scheduler/kv_events.py's KVEventPublisher): its batches decode
with vLLM's schema, written here independently of ours; a live ``radixserve serve`` publishes
what it caches and evicts; the flags that turn it on are checked.

The smg test runs smg's own KV event relay (the Rust gRPC servicer inside ``pip install smg``,
which turns an engine's ZMQ events into the ``SubscribeKvEvents`` stream its router indexes)
against our publisher. smg keeps its own virtual environment: ``SMG_VENV`` (default
/work/smg-venv) with ``smg`` and ``smg-grpc-proto`` installed; the test is skipped when that
environment is missing. smg cannot route to a radixserve server end to end: its event-driven
mode serves gRPC workers only (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from engine.commands.options import add_engine_arguments
from engine.contracts.engine_config import EngineConfig
from engine.contracts.kv_events import BlockStored
from scheduler.kv_events import BlockEvents, KVEventPublisher
from tests.kv_gateway import Subscriber
from tests.radix_sim import Sim
from tests.server_process import AUTH, ServerProcess, free_port


# ------------------------------------------------------------------ vLLM's schema, written anew
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base event: a map tagged "type" with the class name (vLLM >= 0.26)."""


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


vllm_decoder = msgspec.msgpack.Decoder(VKVEventBatch)


def recv_batches(sub: zmq.Socket, timeout: float, until) -> list[tuple[int, VKVEventBatch]]:
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(got):
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            got.append((int.from_bytes(seq, "big"), vllm_decoder.decode(payload)))
    return got


def test_publisher_frames_decode_with_vllm_schema():
    ctx = zmq.Context.instance()
    port = free_port()
    publisher = KVEventPublisher(ctx, f"tcp://*:{port}")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        sim = Sim(num_pages=32, page_size=4)
        events = BlockEvents(4)
        events.attach(sim.tree)
        # PUB drops what it sends before the subscription arrives: probe until one lands.
        while not recv_batches(sub, 0.2, lambda g: g):
            publisher.publish([VAllBlocksCleared()])
        recv_batches(sub, 0.3, lambda g: False)  # drain the probes still on their way
        sim.finish(sim.admit(list(range(20))))
        first = publisher.sequence
        publisher.publish(events.take(), ts=123.5)
        (seq, batch), = recv_batches(sub, 5.0, lambda g: g)
        assert seq == first and batch.ts == 123.5 and batch.data_parallel_rank == 0
        (stored,) = batch.events
        assert isinstance(stored, VBlockStored) and stored.medium == "GPU"
        assert stored.token_ids == list(range(20)) and stored.block_size == 4
        assert stored.parent_block_hash is None and len(stored.block_hashes) == 5
        publisher.publish([])  # a step that changed nothing sends nothing
        sim.tree.reset()
        publisher.publish(events.take())
        (seq2, batch2), = recv_batches(sub, 5.0, lambda g: g)
        assert seq2 == seq + 1
        assert [type(e) for e in batch2.events] == [VBlockRemoved, VAllBlocksCleared]
        assert sorted(batch2.events[0].block_hashes) == sorted(stored.block_hashes)
    finally:
        sub.close(0)
        publisher.close()


# ------------------------------------------------------------------ a live server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    srv = ServerProcess(tmp_path_factory.mktemp("kv-events"), "--num-pages", "24",
                        "--page-size", "16", "--kv-events-endpoint", f"tcp://*:{port}",
                        "--kv-events-block-size", "8")
    srv.events_port = port
    yield srv
    assert srv.stop() == 0


def generate(server, input_ids: list[int], cache_salt: str | None = None) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    if cache_salt:
        body["cache_salt"] = cache_salt
    reply = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


@pytest.mark.e2e
def test_a_live_server_publishes_what_it_caches_and_evicts(server):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{server.events_port}")
    gateway = Subscriber()
    try:
        time.sleep(1.0)  # let the subscription reach the publisher (PUB keeps no history)
        prompt = [(7 * i) % 500 + 3 for i in range(70)]
        output = generate(server, prompt)
        batches = recv_batches(sub, 10.0, lambda g: any(
            isinstance(e, VBlockStored) for _, b in g for e in b.events))
        assert batches, "no KV events from the server"
        chain = []
        for _, batch in batches:
            assert batch.data_parallel_rank == 0
            for event in batch.events:
                gateway.apply(event)
                if isinstance(event, VBlockStored):
                    assert event.block_size == 8
                    chain += event.token_ids
        assert len(chain) >= 64 and chain == (prompt + output)[: len(chain)]
        salted = generate(server, prompt, cache_salt="tenant-a")
        assert salted == output
        # 24 pages of 16 slots: a few more distinct prompts evict the first ones.
        for k in range(1, 6):
            generate(server, [(11 * i + k) % 500 + 3 for i in range(90)])
        more = recv_batches(sub, 10.0, lambda g: any(
            isinstance(e, VBlockRemoved) for _, b in g for e in b.events))
        seqs = [seq for seq, _ in batches + more]
        for _, batch in more:
            for event in batch.events:
                gateway.apply(event)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap in sequence numbers"
        assert any(isinstance(e, VBlockRemoved) for _, b in more for e in b.events)
        salted_events = [e for _, b in more for e in b.events
                         if isinstance(e, VBlockStored) and e.extra_keys]
        # The scheduler's namespace is the salt's digest (engine/server/service.py), never the salt.
        digest = hashlib.sha256(msgspec.json.encode([None, "tenant-a"])).hexdigest()
        assert salted_events and salted_events[0].extra_keys[0] == (digest,)
    finally:
        sub.close(0)


@pytest.mark.parametrize("values,message", [
    ({"kv_events_endpoint": "localhost:5557"}, "tcp:// or ipc://"),
    ({"kv_events_block_size": 16}, "needs --kv-events-endpoint"),
    ({"kv_events_endpoint": "tcp://*:5557", "kv_events_block_size": 0}, "at least 1"),
])
def test_bad_kv_event_flags_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **values).validate()


def test_kv_event_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-events-endpoint", "tcp://*:5557"])
    config = EngineConfig(**{f: getattr(args, f) for f in ("kv_events_endpoint",
                                                            "kv_events_block_size")}, model="m")
    assert config.kv_events_endpoint == "tcp://*:5557" and config.kv_events_block == 16
    assert EngineConfig(model="m", kv_events_block_size=8).kv_events_block == 8


SMG_PYTHON = Path(os.environ.get("SMG_VENV", "/work/smg-venv")) / "bin" / "python"
RELAY_SCRIPT = """
import json, sys, grpc
from smg.servicer import VllmGrpcServer
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
events, grpc_port, handshake_port, ipc_dir, model, seconds = sys.argv[1:]
server = VllmGrpcServer(f"127.0.0.1:{grpc_port}", f"ipc://{ipc_dir}/engine",
                        f"tcp://127.0.0.1:{handshake_port}", model, block_size=4,
                        kv_events_endpoint=events)
stub = vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
try:
    for batch in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(),
                                        timeout=float(seconds), wait_for_ready=True):
        out = []
        for e in batch.events:
            kind = e.WhichOneof("data")
            if kind == "stored":
                out.append(["stored", [[b.block_hash, list(b.token_ids)] for b in e.stored.blocks],
                            e.stored.parent_block_hash if e.stored.HasField("parent_block_hash")
                            else None])
            elif kind == "removed":
                out.append(["removed", list(e.removed.block_hashes)])
            else:
                out.append([kind])
        print(json.dumps([batch.sequence_number, out]), flush=True)
except grpc.RpcError as exc:
    print(json.dumps(["end", str(exc.code())]), flush=True)
server.stop()
"""


def smg_relay_available() -> bool:
    if not SMG_PYTHON.exists():
        return False
    probe = subprocess.run([str(SMG_PYTHON), "-c", "import smg.servicer, smg_grpc_proto, grpc"],
                           capture_output=True)
    return probe.returncode == 0


def as_int64(value: int) -> int:
    """smg's proto carries block hashes as int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


@pytest.mark.e2e
@pytest.mark.skipif(not smg_relay_available(), reason="smg (+ smg-grpc-proto) not in SMG_VENV")
def test_smg_relay_reads_our_events(tmp_path):
    ctx = zmq.Context.instance()
    port = free_port()
    publisher = KVEventPublisher(ctx, f"tcp://*:{port}")
    (tmp_path / "model").mkdir()
    relay = subprocess.Popen(
        [str(SMG_PYTHON), "-c", RELAY_SCRIPT, f"tcp://127.0.0.1:{port}", str(free_port()),
         str(free_port()), str(tmp_path), str(tmp_path / "model"), "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sim = Sim(num_pages=12, page_size=4)
    events = BlockEvents(4)
    events.attach(sim.tree)
    sent = {}
    try:
        # The relay subscribes when the stream opens; PUB keeps no history, so publish a new
        # path every 0.2 s (eviction makes room, and removals) until the relay has passed a few.
        for k in range(30):
            sim.finish(sim.admit([k + 1] + [100 + k * 10 + i for i in range(14)]))
            sent[publisher.sequence] = events.take()
            publisher.publish(sent[publisher.sequence])
            time.sleep(0.2)
    finally:
        publisher.close()
        out, _ = relay.communicate(timeout=60)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("[")]
    # A relay that joined after the publisher's first batches may answer with a snapshot of
    # the live blocks first (an AllBlocksCleared, then every live block: smg's KvSnapshotChunk);
    # the batches after it are the publisher's own.
    received = [line for line in lines if line[0] != "end" and line[1][:1] != [["cleared"]]]
    assert len(received) >= 5, out
    saw_removal = False
    for seq, got in received:
        expected = []
        for event in sent[seq]:
            if isinstance(event, BlockStored):
                blocks = [[as_int64(h), event.token_ids[4 * i : 4 * i + 4]]
                          for i, h in enumerate(event.block_hashes)]
                parent = event.parent_block_hash
                expected.append(["stored", blocks, None if parent is None else as_int64(parent)])
            else:
                saw_removal = True
                expected.append(["removed", [as_int64(h) for h in event.block_hashes]])
        assert got == expected, f"batch {seq}"
    assert saw_removal
