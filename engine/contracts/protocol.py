"""Messages shared by every process: msgspec Structs in tagged unions, encoded as msgpack.

No Python-object serialisation crosses a socket. Token ids travel as packed int32 bytes
(``pack_ids`` / ``unpack_ids``), never as Python lists.

    frontend ──GenerateRequest/AbortRequest──▶ tokenizer ──TokenizedRequest/AbortRequest──▶ scheduler
    frontend ◀────────RequestOutput─────────── tokenizer ◀──────TokenOutputs───────────── scheduler
    frontend ◀───────SchedulerStats─────────── tokenizer ◀──(TokenOutputs.stats)───────── scheduler
                                                          scheduler ──ForwardBatch──▶ worker
                                                          scheduler ◀──BatchResult/WorkerReady── worker
    frontend ──LoraUpdate──▶ tokenizer ──▶ scheduler ──▶ worker, and LoraUpdated all the way back
    frontend ──TokenizeRequest/DetokenizeRequest──▶ tokenizer ──TokenizerReply──▶ frontend
    every child ──Ready/Fatal──▶ launcher
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from engine.contracts.lora import LoraAdapterInfo
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.worker_messages import BatchResult, ForwardBatch, ModelInfo, WorkerReady


def pack_ids(ids: np.ndarray | list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


# --------------------------------------------------------------------------- requests
class GenerateRequest(msgspec.Struct, tag=True, kw_only=True):
    """Frontend → tokenizer. Exactly one of ``text``, ``prompt_ids`` or ``messages``."""

    rid: str
    params: SamplingParams
    text: str | None = None
    prompt_ids: bytes | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # with messages: OpenAI's tools, for the chat template
    namespace: str | None = None
    session_id: str | None = None  # the scheduler-side history to continue (multi-turn)
    stream: bool = True
    echo: bool = False  # the first output carries the prompt's text (``prompt_text``)
    lora_name: str | None = None  # the LoRA adapter the request's ``model`` named


class AbortRequest(msgspec.Struct, tag=True):
    """Frontend → tokenizer → scheduler: stop a request and release its pages."""

    rid: str
    reason: str = "abort"
    index: int = -1  # one sample of the request, or -1 for all of them


class TokenizedRequest(msgspec.Struct, tag=True, kw_only=True):
    """Tokenizer → scheduler."""

    rid: str
    prompt_ids: bytes
    params: SamplingParams
    reply_to: int  # index of the tokenizer worker that gets this request's outputs
    namespace: str | None = None
    session_id: str | None = None
    arrival: float = 0.0
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


class SessionOpen(msgspec.Struct, tag=True):
    """Frontend → tokenizer → scheduler: open a multi-turn session (history held server-side);
    with ``parent``, its history starts as a copy of that session's (a stored response's
    continuation, which lives where its parent does)."""

    session_id: str
    ttl: float
    parent: str | None = None


class SessionClose(msgspec.Struct, tag=True):
    session_id: str


class LoraUpdate(msgspec.Struct, tag=True, kw_only=True):
    """Frontend → tokenizer → scheduler → worker: load LoRA adapter ``name`` from ``path`` (a
    PEFT directory), or unload it (``path`` None). The scheduler checks it and gives a load its
    ``lora_id`` (never reused); the worker answers with a ``LoraUpdated``."""

    rid: str
    name: str
    path: str | None = None
    reply_to: int = 0  # the tokenizer worker the answer goes back through
    lora_id: int = 0
    # Tensor parallel, rank 0 to the others: the hash of the files it read, which theirs must
    # equal (else the ranks would serve different weights; engine/worker/tp_rank.py)
    content_hash: str = ""


class LoraUpdated(msgspec.Struct, tag=True, kw_only=True):
    """Worker → scheduler → tokenizer → frontend: how a ``LoraUpdate`` ended (``error`` with
    its ``status``, or the adapter loaded) and, from the scheduler, every adapter now loaded."""

    rid: str
    reply_to: int = 0
    adapter: LoraAdapterInfo | None = None
    error: str | None = None
    status: int = 200
    adapters: list[LoraAdapterInfo] = []


class TokenizeRequest(msgspec.Struct, tag=True, kw_only=True):
    """Frontend → tokenizer (``/tokenize``): exactly one of ``text`` or chat ``messages`` to
    token ids, the way a completion or chat request's prompt would be; answered by a
    ``TokenizerReply``. Nothing reaches the scheduler."""

    rid: str
    text: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True  # text: BOS as a completion adds it; messages: on top
    add_generation_prompt: bool = True  # messages: end with the assistant turn's opening
    return_token_strs: bool = False
    tools: list[dict] | None = None  # messages: the tools the chat template renders


class DetokenizeRequest(msgspec.Struct, tag=True, kw_only=True):
    """Frontend → tokenizer (``/detokenize``): token ids (checked against the vocabulary by
    the frontend) to text; answered by a ``TokenizerReply``."""

    rid: str
    token_ids: bytes


class TokenizerReply(msgspec.Struct, tag=True, kw_only=True):
    """Tokenizer → frontend: a ``TokenizeRequest``'s ids (and each token's string, if asked)
    or a ``DetokenizeRequest``'s text, or ``error`` with its status."""

    rid: str
    token_ids: bytes = b""
    token_strs: list[str] | None = None
    text: str = ""
    error: str | None = None
    status: int = 200


# ---------------------------------------------------------------------------- outputs
class SeqOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one sequence of a request since the last message."""

    rid: str
    index: int  # which of the n samples / beams
    token_ids: bytes
    logprobs: bytes = b""  # float32 per token, when asked
    top_ids: bytes = b""  # int32 [tokens, N]
    top_logprobs: bytes = b""  # float32 [tokens, N]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    status: int = 200  # with an error: 400 bad input, 503 overload, 500 a bug
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replace: bool = False  # beam search: token_ids replace everything sent before
    # prompt_logprobs: the next prompt tokens' logprobs (float32; the first prompt token has
    # none, so a request's chunks together hold prompt_len - 1), their top-N ids and logprobs
    prompt_logprobs: bytes = b""
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    # of cached_tokens, those loaded from the host tier / the disk tier; None when the engine
    # has no such tier
    cached_tokens_host: int | None = None
    cached_tokens_disk: int | None = None


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """The scheduler's gauges and counters (``Scheduler.stats()``), for the frontend's metrics.

    Rides on a ``TokenOutputs`` at most a few times a second and whenever the scheduler goes
    idle; the tokenizer worker forwards it to the frontend as its own message.
    """

    running: int = 0
    waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_cached: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    preemptions: int = 0
    sessions_pinned: int = 0
    pinned_tokens: int = 0
    # speculative decoding (scheduler/speculation.py); spec_method is "" when it is off
    spec_method: str = ""
    spec_drafted_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_emitted_tokens: int = 0  # tokens verifications produced (accepted + one each)
    spec_verifications: int = 0  # sequence-steps that verified drafts
    spec_model_drafted_tokens: int = 0  # of spec_drafted_tokens, the draft model's
    spec_model_accepted_tokens: int = 0  # of those, accepted
    spec_model_pauses: int = 0  # sequences' pauses of the draft model (not worth its cost)
    spec_model_off_steps: int = 0  # sequence-steps without it: slower with it at that size
    # structured output (engine/worker/grammar.py)
    constrained_requests: int = 0  # requests admitted with a constraint
    grammar_forced_tokens: int = 0  # tokens grammars forced (appended without their own step)
    grammar_mask_seconds: float = 0.0  # host time filling token masks (beside the forwards)
    # the sliding-window layers' own pages (radix/sliding.py); total is 0 when they have none
    sliding_pages_total: int = 0
    sliding_pages_used: int = 0  # held by running requests' windows or locked nodes
    sliding_pages_cached: int = 0  # windows the prefix cache keeps, evictable
    sliding_evicted_pages: int = 0
    sliding_loaded_pages: int = 0  # evicted windows of cached prefixes read back from the host tier
    # the host tier of the prefix cache (radix/host.py); pages_total is 0 when it is off
    host_cache_pages_total: int = 0
    host_cache_pages_used: int = 0  # holding KV (pinned or evictable)
    # its pages for the sliding-window layers' kept windows (0 without them)
    host_cache_sliding_pages_total: int = 0
    host_cache_sliding_pages_used: int = 0
    host_hit_tokens: int = 0  # of hit_tokens, those found only in the host tier
    host_pages_written: int = 0  # device pages copied down
    host_pages_loaded: int = 0  # host pages loaded back onto the device
    host_transfer_seconds: float = 0.0  # worker time copying pages between host and device
    # the disk tier (engine/contracts/disk_cache.py); disk_block_tokens is 0 when it is off
    disk_block_tokens: int = 0
    disk_on: int = 0  # 1 while it serves (set up, its directory there); replicas summed
    disk_hit_tokens: int = 0  # of hit_tokens, those loaded from disk
    disk_blocks_saved: int = 0  # blocks sent to be written (the worker skips those present)
    disk_blocks_loaded: int = 0
    disk_load_failures: int = 0  # loads that ended early (a block missing or failing a check)
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_load_seconds: float = 0.0  # the worker's I/O thread reading and placing blocks
    disk_rejected_files: int = 0  # corrupt, truncated or foreign files skipped and removed


class TokenOutputs(msgspec.Struct, tag=True):
    """Scheduler → tokenizer, once per step for the requests that worker owns."""

    outputs: list[SeqOutput]
    stats: SchedulerStats | None = None
    # time.monotonic() when the scheduler got the step result these outputs come from (0: not
    # from a step), carried on to the frontend to time the hops (its delivery histogram)
    result_at: float = 0.0


class RequestOutput(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Tokenizer → frontend: one sequence's text and token delta."""

    rid: str
    index: int = 0
    text: str = ""
    token_ids: bytes = b""
    logprobs: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended the output (vLLM's name)
    error: str | None = None
    status: int = 200  # HTTP-like status of an error: 400 bad input, 503 overload, 500 bug
    # a 400 about the request's output constraint (its structured output does not compile),
    # not about its prompt: the door names the field the constraint came from
    about_constraint: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_host: int | None = None  # of those, loaded from the host tier (if any)
    cached_tokens_disk: int | None = None  # of those, loaded from the disk tier (if any)
    replace: bool = False
    result_at: float = 0.0  # TokenOutputs.result_at of the step that produced these tokens
    # With logprobs: each token's text, then each top alternative's (tokens x N, row-major).
    token_texts: list[str] = []
    top_texts: list[str] = []
    # echo: the prompt's text, on the request's first output
    prompt_text: str = ""
    # prompt_logprobs, in prompt order across outputs: the next prompt tokens (ids, texts),
    # their logprobs, and their top-N alternatives (ids, logprobs, texts; tokens x N)
    prompt_token_ids: bytes = b""
    prompt_token_texts: list[str] = []
    prompt_logprobs: bytes = b""
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    prompt_top_texts: list[str] = []


class Ready(msgspec.Struct, tag=True):
    """Any child → launcher once it serves; the scheduler's carries the model's facts."""

    name: str
    pid: int
    info: ModelInfo | None = None


class Fatal(msgspec.Struct, tag=True):
    """Any child → launcher just before it exits on an error it cannot serve past."""

    name: str
    error: str


class Shutdown(msgspec.Struct, tag=True):
    pass


# ------------------------------------------------------------------- data parallel
class ReplicaDown(msgspec.Struct, tag=True):
    """Launcher → tokenizer (``--dp-size`` > 1): a replica's scheduler or worker exited. Its
    requests that had output fail, those that had none go to another replica, and nothing
    more is routed to it."""

    replica: int
    reason: str


class ReplicaLoad(msgspec.Struct, array_like=True, omit_defaults=True):
    """One replica as one tokenizer worker's dispatcher sees it. Counters only grow; the cached
    token counters cover the same requests (those that finished after the replica admitted
    them): what the dispatcher predicted from the replica's KV events and what the replica
    reported in ``cached_tokens``."""

    alive: bool = True
    in_flight: int = 0
    routed: int = 0
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0
    cached_blocks: int = 0  # blocks the dispatcher's copy of the replica's cache holds
    resets: int = 0  # times that copy was dropped (a gap in the events, a restart)
    stats: SchedulerStats | None = None  # the replica scheduler's latest stats seen here


class DispatchStats(msgspec.Struct, tag=True):
    """Tokenizer → frontend (on its own socket): the dispatcher's replicas, whenever changed."""

    tokenizer: int
    replicas: list[ReplicaLoad]


Message = (
    GenerateRequest | AbortRequest | TokenizedRequest | SessionOpen | SessionClose | LoraUpdate
    | LoraUpdated | TokenizeRequest | DetokenizeRequest | TokenizerReply | TokenOutputs
    | SchedulerStats | RequestOutput | ForwardBatch | BatchResult | WorkerReady | Ready | Fatal | Shutdown
    | ReplicaDown | DispatchStats
)

# Integer numpy arrays (a step's) travel as one msgpack extension each: ndim, shape, then the
# int32 values; they decode as read-only views of the message, with no copy.
_ARRAY_EXT = 1


def _enc_hook(obj: object) -> msgspec.msgpack.Ext:
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "iu":
        values = np.ascontiguousarray(obj, dtype=np.int32)
        header = struct.pack(f"<B{values.ndim}I", values.ndim, *values.shape)
        return msgspec.msgpack.Ext(_ARRAY_EXT, header + values.tobytes())
    raise TypeError(f"cannot encode {type(obj).__name__} {getattr(obj, 'dtype', '')} in a message")


def _ext_hook(code: int, data: memoryview) -> np.ndarray:
    if code != _ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    ndim = data[0]
    shape = struct.unpack_from(f"<{ndim}I", data, 1)
    return np.frombuffer(data, dtype=np.int32, offset=1 + 4 * ndim).reshape(shape)


def _dec_hook(kind: type, obj: object) -> object:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {kind.__name__}, got {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook, dec_hook=_dec_hook)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
