"""Stored responses (``/v1/responses`` with ``store``): each is a session turn. Its session's
history (token ids as generated, in the tokenizer worker) ends with the response, and its KV is
pinned like any session turn's (``--session-ttl``, ``--max-pinned-tokens``); a response that
continues it (``previous_response_id``) opens a session forked from it, so a chain
re-tokenizes nothing and hits the whole history.

Sessions bound the store: a stored response holds one of ``--max-sessions``, and the session
table reclaiming it (idle past its ttl, to open another) forgets the response. A response
belongs to the API key that made it (a hash of it); another key is told it does not exist.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.server.errors import APIError
from engine.server.responses_schemas import ResponseObject


def owner_of(key: str | None) -> str | None:
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()


@dataclass
class StoredResponse:
    response: ResponseObject
    owner: str | None
    session_id: str
    cancelled: bool = False  # a cancel asked while it runs: it stops at its next output


class ResponseStore:
    def __init__(self) -> None:
        self.responses: dict[str, StoredResponse] = {}
        self.by_session: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.responses)

    def put(self, stored: StoredResponse) -> None:
        self.responses[stored.response.id] = stored
        self.by_session[stored.session_id] = stored.response.id

    def get(self, response_id: str, owner: str | None, param: str | None = None
            ) -> StoredResponse:
        stored = self.responses.get(response_id)
        if stored is None or stored.owner != owner:
            raise APIError(404, f"response {response_id[:80]!r} does not exist: it was never "
                           "stored, was deleted, or expired (its session was reclaimed)",
                           param=param)
        return stored

    def remove(self, response_id: str) -> StoredResponse | None:
        stored = self.responses.pop(response_id, None)
        if stored is not None:
            self.by_session.pop(stored.session_id, None)
        return stored

    def forget_session(self, session_id: str) -> None:
        """The session table reclaimed ``session_id``: its response goes with it."""
        response_id = self.by_session.pop(session_id, None)
        if response_id is not None:
            self.responses.pop(response_id, None)
