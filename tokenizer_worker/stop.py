"""Stop strings over a stream of text deltas."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Cuts a streamed text at its first stop string without ever emitting text to take back.

    Contract: the text emitted by ``feed`` and ``flush`` joins to the full text cut at the
    earliest position where any stop string occurs, whatever the chunking, as if the whole
    text had been searched at once. Among stop strings found at that same position the shortest
    wins (it completes first). ``include_stop`` keeps the stop string itself in the output.

    Held text: the checker emits text only up to the earliest position where a stop string
    could still begin, i.e. where the rest of the text is a proper prefix of some stop string::

        seen text = [ emitted ............ | held: "\\nUs" ]    stop=["\\nUser:"]

    Waiting for the earliest position: when one stop string completes while another that
    started earlier is still incomplete, the checker holds both until the earlier one completes
    (it wins) or fails (the later one wins). Between calls the held text is shorter than the
    longest stop string, so the work of a ``feed`` depends on its delta and the stop strings,
    never on the length of the whole text.

    ``matched`` is the stop string that ended the text (None until one does); after that,
    ``feed`` returns ("", True) and ``flush`` returns "".
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        if isinstance(stop, str):
            raise ValueError("stop must be a list of strings, not a single string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add the next piece of text; return (text safe to emit now, whether a stop matched)."""
        if self.matched is not None:
            return "", True
        self._held += delta
        match = self._earliest_match()
        candidate = self._earliest_candidate()
        if match is not None and match[0] <= candidate:
            return self._finish(match), True
        # Either no match yet, or one that a stop string starting earlier can still beat:
        # everything before that earlier start is safe.
        emitted, self._held = self._held[:candidate], self._held[candidate:]
        return emitted, False

    def flush(self) -> str:
        """Release the held text once the stream has ended (the rest up to a stop, if one matched)."""
        if self.matched is not None:
            return ""
        match = self._earliest_match()
        if match is not None:
            # Stop strings still in progress before it can no longer complete.
            return self._finish(match)
        emitted, self._held = self._held, ""
        return emitted

    def _earliest_match(self) -> tuple[int, str] | None:
        """(start, stop) of the earliest complete stop string in the held text, shortest first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = self._held.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _earliest_candidate(self) -> int:
        """Start of the longest held suffix that is a proper prefix of a stop (or len(held))."""
        held = self._held
        earliest = len(held)
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(held)), 0, -1):
                if len(held) - length >= earliest:
                    break
                if held.endswith(stop[:length]):
                    earliest = len(held) - length
                    break
        return earliest

    def _finish(self, match: tuple[int, str]) -> str:
        start, stop = match
        end = start + len(stop) if self._include_stop else start
        emitted = self._held[:end]
        self._held = ""
        self.matched = stop
        return emitted
