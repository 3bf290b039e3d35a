"""StopChecker: emitted text == full text cut at the earliest stop string, whatever the chunking."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tokenizer_fixtures import TOKENIZERS, chunked
from tokenizer_worker.detokenize import IncrementalDetokenizer
from tokenizer_worker.stop import StopChecker


def reference(text: str, stops: Sequence[str], include_stop: bool) -> tuple[str, str | None]:
    """The whole text cut at its earliest stop string (shortest first at one position)."""
    found = [(text.find(s), len(s), s) for s in stops if s in text]
    if not found:
        return text, None
    start, length, stop = min(found)
    return text[: start + length if include_stop else start], stop


def run(checker: StopChecker, chunks: Sequence[str]) -> tuple[str, bool]:
    """Feed the chunks until a stop; return the emitted text and whether a feed stopped."""
    emitted = []
    for chunk in chunks:
        text, stopped = checker.feed(chunk)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True
    emitted.append(checker.flush())
    return "".join(emitted), False


def test_stop_string_spanning_many_deltas() -> None:
    checker = StopChecker(["\nUser:"])
    assert checker.feed("Sure, here it is.") == ("Sure, here it is.", False)
    assert checker.feed("\n") == ("", False)
    assert checker.feed("") == ("", False)
    assert checker.feed("Us") == ("", False)
    assert checker.feed("e") == ("", False)
    assert checker.feed("r: and more") == ("", True)
    assert checker.matched == "\nUser:"
    assert checker.feed("ignored") == ("", True)
    assert checker.flush() == ""


def test_false_start_is_released() -> None:
    checker = StopChecker(["\nUser:"])
    assert checker.feed("a\nUs") == ("a", False)
    assert checker.feed("ually") == ("\nUsually", False)
    assert checker.matched is None


def test_include_stop_keeps_the_stop_string() -> None:
    checker = StopChecker(["END"], include_stop=True)
    assert checker.feed("the EN") == ("the ", False)
    assert checker.feed("D!") == ("END", True)


def test_text_before_the_stop_in_the_same_delta() -> None:
    assert StopChecker(["stop"]).feed("go go stop go") == ("go go ", True)


def test_earliest_position_wins_over_first_completed() -> None:
    # "y" completes first, but "xyz" starts earlier: wait to see whether it completes.
    checker = StopChecker(["xyz", "y"])
    assert checker.feed("axy") == ("a", False)
    assert checker.feed("z") == ("", True)
    assert checker.matched == "xyz"

    checker = StopChecker(["xyz", "y"])
    assert checker.feed("axy") == ("a", False)
    assert checker.feed("w") == ("x", True)
    assert checker.matched == "y"


def test_flush_settles_a_match_waiting_on_an_earlier_candidate() -> None:
    checker = StopChecker(["xyz", "y"])
    assert checker.feed("axy") == ("a", False)
    assert checker.flush() == "x"
    assert checker.matched == "y"


def test_flush_releases_a_held_prefix() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.feed("42</ans") == ("42", False)
    assert checker.flush() == "</ans"
    assert checker.matched is None


def test_no_stop_strings_pass_everything() -> None:
    checker = StopChecker([])
    assert checker.feed("anything") == ("anything", False)
    assert checker.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""], "stop", [None]])
def test_invalid_stop_strings_are_rejected(stop: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopChecker(stop)  # type: ignore[arg-type]


small_text = st.text(alphabet="abc\n", max_size=30)
stop_lists = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), max_size=4)
chunk_sizes = st.lists(st.integers(0, 4), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(
    text=small_text,
    stops=stop_lists,
    include_stop=st.booleans(),
    sizes=chunk_sizes,
)
def test_matches_the_whole_text_reference(
    text: str, stops: list[str], include_stop: bool, sizes: list[int]
) -> None:
    checker = StopChecker(stops, include_stop=include_stop)
    emitted, stopped_in_feed = run(checker, chunked(text, sizes))
    expected, expected_stop = reference(text, stops, include_stop)
    assert emitted == expected
    assert checker.matched == expected_stop
    if expected_stop is not None and not stopped_in_feed:
        # Only flush may settle a stop, and only when a stop string that starts earlier was
        # still incomplete at the end of the text.
        start = text.find(expected_stop)
        assert any(
            len(s) > len(text) - j and s.startswith(text[j:]) for j in range(start) for s in stops
        )


@settings(max_examples=200, deadline=None)
@given(text=small_text, stops=stop_lists, sizes=chunk_sizes)
def test_holds_back_less_than_the_longest_stop(
    text: str, stops: list[str], sizes: list[int]
) -> None:
    checker = StopChecker(stops)
    fed = emitted = 0
    for chunk in chunked(text, sizes):
        out, stopped = checker.feed(chunk)
        if stopped:
            break
        fed += len(chunk)
        emitted += len(out)
        assert fed - emitted <= max((len(s) for s in stops), default=1) - 1


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab é你😀\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab é你😀\n", min_size=1, max_size=3), max_size=3),
)
def test_detokenizer_deltas_through_stop_checker(name: str, text: str, stops: list[str]) -> None:
    """The tokenizer worker's pipeline: token ids -> text deltas -> stop strings."""
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    checker = StopChecker(stops)
    emitted = []
    for token_id in ids:
        out, stopped = checker.feed(detokenizer.add([token_id]))
        emitted.append(out)
        if stopped:
            break
    else:
        out, stopped = checker.feed(detokenizer.flush())
        emitted.append(out if stopped else out + checker.flush())
    expected, _ = reference(tokenizer.decode(ids), stops, include_stop=False)
    assert "".join(emitted) == expected
