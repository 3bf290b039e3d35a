"""Incremental detokenization: a request's output token ids in, UTF-8-safe text deltas out.

Decoding the whole output every step costs O(length) per token. Decoding each token on its own
breaks characters that a byte-level BPE splits across tokens, and loses the spaces that
SentencePiece-style decoders strip from the start of a decoded string. The prefix-offset /
read-offset technique of TGI and vLLM avoids both: decode a short window of recent tokens with
and without the new ones, and emit the difference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as context so that the first output tokens are decoded mid-text, where a
# SentencePiece decoder keeps their leading space (vLLM keeps 5).
PROMPT_CONTEXT_TOKENS = 6


@functools.lru_cache(maxsize=8)
def _vocab_facts(tokenizer: PreTrainedTokenizerBase) -> tuple[frozenset[int], frozenset[int]]:
    """What the detokenizer must know about a vocabulary, computed once per tokenizer: its
    byte-fallback ids and the special ids that skip_special_tokens drops."""
    vocab = tokenizer.get_vocab()
    # The ByteFallback decoder reads any token spelled <0xNN> (either case of hex) as a raw byte.
    byte_names = [f"<0x{b:02X}>" for b in range(256)] + [f"<0x{b:02x}>" for b in range(256)]
    byte_ids = {vocab[name] for name in byte_names if name in vocab}
    # skip_special_tokens drops added tokens flagged special before the decoder runs, so they
    # are transparent to it; checking that each decodes to nothing alone guards against a
    # backend whose notion of "special" differs, since dropping a token that has text loses it.
    skipped = {token_id for token_id, token in tokenizer.added_tokens_decoder.items()
               if token.special and tokenizer.decode([token_id], skip_special_tokens=True) == ""}
    return frozenset(byte_ids), frozenset(skipped)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, step by step.

    Contract: ``"".join(add(...) for each step) + flush()`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)``, and no delta holds a character
    that later tokens could still change: an incomplete UTF-8 character is held back until it
    completes (or, at ``flush``, is given as the decoder renders it). With ``prompt_ids`` the
    output is decoded as the continuation of the prompt (so a "▁word" token right after the
    prompt reads " word", not "word"): the deltas join to the part of
    ``decode(prompt_ids + output_ids)`` after its common prefix with ``decode(prompt_ids)``.
    Only the last few prompt ids are read, so passing the whole prompt costs nothing. Decoding
    never applies the legacy ``clean_up_tokenization_spaces`` rewrite (transformers skips it
    for BPE tokenizers anyway).

    State: ``window`` holds the ids from the prefix offset on (older ids are dropped)::

        window = [ emitted last step (or prompt context) | not emitted yet .......... ]
                   0                                      ^read           ^closed    ^len
        prefix text = decode(window[:read])    new text = decode(window[:closed])
        emitted so far = everything before the window + prefix text + the complete
                         characters of new text already sent ahead of a broken tail

    A step emits ``new text - prefix text`` and then moves the window start to ``read`` and
    ``read`` to ``closed``. The read offset stays put (the window grows) while:

    - the new text ends in U+FFFD: a byte-level BPE split a character and the rest of its bytes
      are still to come. The complete characters before that tail are final and are emitted
      at once; only the broken character waits;
    - ``window[closed:]`` is a run of ``<0xNN>`` byte-fallback tokens: the ByteFallback decoder
      decodes a run all or nothing (one invalid byte turns every byte of the run into U+FFFD),
      so none of the run's text is final until a non-byte token ends it. This is the price of
      the exact contract: a long run (CJK text in a vocabulary without those characters)
      streams in one piece when it ends;
    - the new tokens add no text. This also keeps the prefix text non-empty, which the
      diff relies on: SentencePiece-style decoders strip the leading space of the first token
      they decode, and that token must be one whose text was already emitted.

    Cost per step: at most two decodes of the window, which spans the last emitted step plus the
    tokens since: a few tokens for real text. It grows only while the read offset waits, and
    no decoding happens at all while a byte-fallback run is open.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._byte_ids, skipped_ids = _vocab_facts(tokenizer)
        # Skipped specials are dropped on arrival: they produce no text and the decoder never
        # sees them, so the window only ever holds tokens that matter to it.
        self._dropped_ids = skipped_ids if skip_special_tokens else frozenset()
        self._window: list[int] = self._prompt_context(prompt_ids or ())
        self._read = len(self._window)
        self._closed = self._closed_end(self._window)
        self._prefix_text: str | None = None
        # Complete characters already emitted from past the read offset, sent ahead of the
        # incomplete character that shares their tokens.
        self._emitted_past_read = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append a step's new token ids; return the text they make final (may be "")."""
        for token_id in token_ids:
            token_id = int(token_id)
            if token_id in self._dropped_ids:
                continue
            self._window.append(token_id)
            if token_id not in self._byte_ids:
                self._closed = len(self._window)
        if self._closed <= self._read:
            return ""
        return self._advance(self._closed, final=False)

    def flush(self) -> str:
        """Return all text still held back; call once, when the output is complete."""
        return self._advance(len(self._window), final=True)

    def _advance(self, end: int, final: bool) -> str:
        new_text = self._decode(self._window[:end])
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        prefix_text = self._prefix_text
        if new_text.startswith(prefix_text):
            new_from = len(prefix_text)
        else:
            # Only at the prompt boundary: the prompt ended inside a character (or inside a
            # byte run) that the output completed, so the text from that character on is new.
            new_from = len(os.path.commonprefix([prefix_text, new_text]))
        unsent_from = new_from + self._emitted_past_read
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            # The characters before the broken tail are complete and can no longer change.
            delta = new_text.rstrip(REPLACEMENT_CHAR)[unsent_from:]
            self._emitted_past_read += len(delta)
            return delta
        if len(new_text) == new_from:
            return ""
        del self._window[: self._read]
        self._closed -= self._read
        self._read = end - self._read
        self._prefix_text = None
        self._emitted_past_read = 0
        return new_text[unsent_from:]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last prompt tokens the output is decoded after, walking back from the end only.

        It reaches back past the prompt's trailing byte-fallback run, if any: the output's first
        bytes may extend that run, and the whole run must be decoded together.
        """
        context: list[int] = []
        passed_trailing_run = False
        for token_id in reversed(prompt_ids):
            if len(context) >= PROMPT_CONTEXT_TOKENS and passed_trailing_run:
                break
            token_id = int(token_id)
            if token_id in self._dropped_ids:
                continue
            context.append(token_id)
            passed_trailing_run = passed_trailing_run or token_id not in self._byte_ids
        context.reverse()
        return context

    def _closed_end(self, token_ids: list[int]) -> int:
        """Index just past the last token that is not a byte-fallback token (0 if none)."""
        for index in range(len(token_ids), 0, -1):
            if token_ids[index - 1] not in self._byte_ids:
                return index
        return 0
