"""The frontend's table of multi-turn chat sessions: which exist, which have a turn running,
and when each was last used. The conversation itself (token ids) lives in the tokenizer worker
that owns the session; its pinned KV in the scheduler (``SessionOpen`` / ``SessionClose``
reach both).

Bounds: at most ``max_sessions`` are open. Opening one more reclaims the least recently used
session idle for longer than ``ttl`` (its KV is no longer pinned by then); when every session is
younger than that, the open fails with 429. One turn at a time per session: a second concurrent
turn gets 409, since its prompt would have to extend a history that is still being written.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from engine.server.errors import APIError


@dataclass
class Session:
    id: str
    created: float  # wall clock, for the API
    last_used: float  # monotonic
    busy: bool = False


class SessionTable:
    def __init__(self, max_sessions: int, ttl: float) -> None:
        self.max_sessions = max_sessions
        self.ttl = ttl
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self) -> tuple[Session, str | None]:
        """A new session, and the id of the idle session reclaimed to make room, if any."""
        reclaimed = None
        if len(self.sessions) >= self.max_sessions:
            now = time.monotonic()
            reclaimed = next((s.id for s in self.sessions.values()
                              if not s.busy and now - s.last_used > self.ttl), None)
            if reclaimed is None:
                raise APIError(429, f"the server already has {self.max_sessions:,} open "
                               "sessions, its limit; close one with DELETE /v1/sessions/{id} "
                               "or retry later")
            del self.sessions[reclaimed]
        session = Session(f"sess-{uuid.uuid4().hex}", time.time(), time.monotonic())
        self.sessions[session.id] = session
        return session, reclaimed

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"session {session_id!r} does not exist (it was closed, "
                           "reclaimed or never opened)", param="session_id")
        return session

    def close(self, session_id: str) -> None:
        self.get(session_id)
        del self.sessions[session_id]

    def begin_turn(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.busy:
            raise APIError(409, f"session {session_id!r} has a turn in progress; send the next "
                           "turn when it has finished", param="session_id")
        session.busy = True
        return session

    def end_turn(self, session: Session) -> None:
        session.busy = False
        session.last_used = time.monotonic()
        if session.id in self.sessions:
            self.sessions.move_to_end(session.id)
