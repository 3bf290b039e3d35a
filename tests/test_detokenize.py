"""IncrementalDetokenizer: deltas join to decode(all), never a broken character, small windows."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tokenizer_fixtures import CORPUS, TOKENIZERS, byte_fallback_ids, chunked
from tokenizer_worker.detokenize import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"
TOKENIZER_NAMES = sorted(TOKENIZERS)


def skipped_ids(tokenizer: Any) -> set[int]:
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def stream(
    tokenizer: Any,
    steps: Sequence[Sequence[int]],
    skip: bool,
    prompt_ids: Sequence[int] | None = None,
) -> list[str]:
    """Run the detokenizer over the steps, checking safety and liveness after every step."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip)
    byte_ids = byte_fallback_ids(tokenizer)
    dropped = skipped_ids(tokenizer) if skip else set()
    deltas: list[str] = []
    seen: list[int] = []
    for step in steps:
        deltas.append(detokenizer.add(step))
        seen.extend(step)
        if prompt_ids:
            continue
        emitted, so_far = "".join(deltas), tokenizer.decode(seen, skip_special_tokens=skip)
        # Safety: nothing emitted disagrees with decoding what has been seen.
        assert so_far.startswith(emitted)
        # Liveness: only a broken tail or an open byte-fallback run is ever held back.
        kept = [token_id for token_id in seen if token_id not in dropped]
        if not (kept and kept[-1] in byte_ids):
            assert emitted == so_far.rstrip(REPLACEMENT_CHAR)
    deltas.append(detokenizer.flush())
    return deltas


def check_replacement_chars(deltas: list[str], full: str) -> None:
    """A U+FFFD in a delta must be one the full decode has at the same spot."""
    position = 0
    for delta in deltas:
        for offset, char in enumerate(delta):
            if char == REPLACEMENT_CHAR:
                assert full[position + offset] == REPLACEMENT_CHAR
        position += len(delta)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_join_to_decode(name: str, data: st.DataObject, skip: bool) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6), label="sizes")
    deltas = stream(tokenizer, chunked(ids, sizes), skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    check_replacement_chars(deltas, full)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_byte_heavy_ids_join_to_decode(name: str, data: st.DataObject, skip: bool) -> None:
    """Ids drawn mostly from byte tokens and specials: runs, broken and completed characters."""
    tokenizer = TOKENIZERS[name]()
    interesting = sorted(byte_fallback_ids(tokenizer) | skipped_ids(tokenizer))
    if name == "byte_level":
        # Single-byte tokens of the byte-level alphabet: lead and continuation bytes.
        interesting += [tokenizer.convert_tokens_to_ids(c) for c in "ÃĢâĪðŁĺĢĳ"]
    id_strategy = st.one_of(st.sampled_from(interesting), st.integers(0, len(tokenizer) - 1))
    ids = data.draw(st.lists(id_strategy, max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6), label="sizes")
    deltas = stream(tokenizer, chunked(ids, sizes), skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    check_replacement_chars(deltas, full)


text_strategy = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(CORPUS), min_size=1, max_size=3).map(" ".join),
    st.text(alphabet="aé你😀 \n▁", max_size=30),
)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(text=text_strategy, data=st.data())
def test_encoded_text_streams_without_broken_characters(
    name: str, text: str, data: st.DataObject
) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = tokenizer.encode(text)
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="sizes")
    deltas = stream(tokenizer, chunked(ids, sizes), skip=True)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    if REPLACEMENT_CHAR not in text:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_output_continues_the_prompt(name: str, data: st.DataObject, skip: bool) -> None:
    """With a prompt, deltas join to what decode(prompt + output) adds after decode(prompt)."""
    tokenizer = TOKENIZERS[name]()
    if data.draw(st.booleans(), label="from text"):
        ids = tokenizer.encode(data.draw(text_strategy, label="text"))
        cut = data.draw(st.integers(0, len(ids)), label="cut")
        prompt_ids, output_ids = ids[:cut], ids[cut:]
    else:
        any_id = st.integers(0, len(tokenizer) - 1)
        prompt_ids = data.draw(st.lists(any_id, max_size=20), label="prompt")
        output_ids = data.draw(st.lists(any_id, max_size=30), label="output")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="sizes")
    deltas = stream(tokenizer, chunked(output_ids, sizes), skip, prompt_ids=prompt_ids)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
    full_text = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=skip)
    common = len(os.path.commonprefix([prompt_text, full_text]))
    assert "".join(deltas) == full_text[common:]


def test_prompt_context_keeps_the_leading_space() -> None:
    tokenizer = TOKENIZERS["metaspace"]()
    prompt_ids = tokenizer.encode("Hello")
    output_ids = [tokenizer.convert_tokens_to_ids("▁fox")]
    with_prompt = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert with_prompt.add(output_ids) + with_prompt.flush() == " fox"
    # Without context the output is decoded on its own, and the decoder strips the space.
    alone = IncrementalDetokenizer(tokenizer)
    assert alone.add(output_ids) + alone.flush() == "fox"


def test_emoji_split_across_tokens_arrives_whole() -> None:
    tokenizer = TOKENIZERS["byte_level"]()
    ids = tokenizer.encode("a🇫🇷b")
    assert len(ids) > 3, "the flag should take several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token_id]) for token_id in ids] + [detokenizer.flush()]
    assert "".join(deltas) == "a🇫🇷b"
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_byte_fallback_run_is_held_until_a_normal_token_ends_it() -> None:
    tokenizer = TOKENIZERS["metaspace"]()
    to_id = tokenizer.convert_tokens_to_ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("x"))
    # "A" as a byte token alone is valid text, but a later invalid byte in the same run would
    # turn it into U+FFFD, so it cannot be emitted yet.
    assert detokenizer.add([to_id("<0x41>")]) == ""
    assert detokenizer.add([to_id("<0x80>")]) == ""
    assert detokenizer.add([to_id("▁fox")]) == "\ufffd\ufffd fox"


def test_special_tokens_kept_or_skipped() -> None:
    tokenizer = TOKENIZERS["metaspace"]()
    ids = tokenizer.encode("Hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += tokenizer.encode("there", add_special_tokens=False)
    for skip, expected in ((True, "Hi there"), (False, "<s> Hi<|im_end|> there")):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = "".join(detokenizer.add([token_id]) for token_id in ids) + detokenizer.flush()
        assert text == expected == tokenizer.decode(ids, skip_special_tokens=skip)


def test_accepts_numpy_ids_and_flush_is_final() -> None:
    tokenizer = TOKENIZERS["byte_level"]()
    ids = np.asarray(tokenizer.encode("numpy ids, café"), dtype=np.int32)
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = detokenizer.add(ids[:3]) + detokenizer.add(ids[3:]) + detokenizer.flush()
    assert text == "numpy ids, café"
    assert detokenizer.flush() == ""


class DecodeRecorder:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.decoded_lengths.append(len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_work_per_step_is_a_small_window(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    prompt_ids = tokenizer.encode(" ".join(CORPUS[:8]))
    output_ids = tokenizer.encode(" ".join(CORPUS), add_special_tokens=False)
    assert len(output_ids) > 1000
    recorder = DecodeRecorder(tokenizer)
    detokenizer = IncrementalDetokenizer(recorder, prompt_ids=prompt_ids)  # type: ignore[arg-type]
    recorder.decoded_lengths.clear()  # the per-tokenizer setup decodes each special once
    text = "".join(detokenizer.add([token_id]) for token_id in output_ids) + detokenizer.flush()
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.endswith(text)
    # At most two decodes per step, none while a byte-fallback run is open. The window spans
    # the last emitted step (or the prompt context) plus the tokens since, and each of those is
    # at most one stretch of tokens with no character boundary inside (several CJK characters
    # in byte-level tokens, a CJK line of byte-fallback tokens in the metaspace vocabulary)
    # plus the token that ends it: the window never approaches the output's length.
    assert len(recorder.decoded_lengths) <= 2 * len(output_ids)
    step = longest_unbroken(tokenizer, output_ids) + 1
    assert max(recorder.decoded_lengths) <= max(PROMPT_CONTEXT_TOKENS, step) + step


def longest_unbroken(tokenizer: Any, ids: list[int]) -> int:
    """Longest run of consecutive token ends that fall inside a character or a byte run."""
    byte_ids = byte_fallback_ids(tokenizer)
    longest, run = 0, 0
    for end in range(1, len(ids) + 1):
        tail = tokenizer.decode(ids[max(0, end - 16) : end])
        inside = ids[end - 1] in byte_ids or tail.endswith(REPLACEMENT_CHAR)
        run = run + 1 if inside else 0
        longest = max(longest, run)
    return longest
