"""Messages of the ZMQ front door: msgspec Structs in tagged unions, encoded as msgpack.

    client (DEALER) ──CompletionCall | ChatCall | GenerateCall──────────────▶ server (ROUTER)
                    ──OpenSessionCall | CloseSessionCall | AbortCall─────────▶
                    ◀─CompletionChunkReply | ChatChunkReply | GenerateChunkReply──
                    ◀─SessionReply | ErrorReply | Done──────────────────────────

Each message is one ZMQ frame. The bodies are the HTTP API's own request Structs, validated the
same way, and the chunks are its stream chunks. Every call carries an id the client picks,
echoed on each reply; generation calls always stream and end with ``Done`` or ``ErrorReply``.
``AbortCall`` stops one (its engine requests are aborted). A server started with ``--api-key``
answers any call without that key in ``api_key`` with a 401 ``ErrorReply``; a message it cannot
read at all gets an ``ErrorReply`` with id "".
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from engine.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    ErrorBody,
    GenerateBody,
    GenerateResponse,
    SessionDeleted,
    SessionObject,
)


class _Message(Struct, tag=True):
    id: str  # the call's, picked by the client and echoed on each reply


class _Call(_Message, kw_only=True):
    api_key: str | None = None  # the server's --api-key, when it has one


class CompletionCall(_Call):
    body: CompletionRequest


class ChatCall(_Call):
    body: ChatCompletionRequest


class GenerateCall(_Call):
    body: GenerateBody


class OpenSessionCall(_Call):
    pass


class CloseSessionCall(_Call):
    session_id: str


class AbortCall(_Call):
    pass


class CompletionChunkReply(_Message):
    chunk: CompletionChunk


class ChatChunkReply(_Message):
    chunk: ChatCompletionChunk


class GenerateChunkReply(_Message):
    chunk: GenerateResponse


class SessionReply(_Message):
    opened: SessionObject | None = None
    deleted: SessionDeleted | None = None


class ErrorReply(_Message):
    status: int
    error: ErrorBody


class Done(_Message):
    pass


ZmqCall = CompletionCall | ChatCall | GenerateCall | OpenSessionCall | CloseSessionCall | AbortCall
ZmqReply = (CompletionChunkReply | ChatChunkReply | GenerateChunkReply | SessionReply | ErrorReply
         | Done)

encoder = msgspec.msgpack.Encoder()
call_decoder = msgspec.msgpack.Decoder(ZmqCall)
reply_decoder = msgspec.msgpack.Decoder(ZmqReply)
