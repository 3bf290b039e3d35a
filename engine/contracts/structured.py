"""Structured output: what a constraint on the generated text means, in one place.

A request constrains its output with exactly one of (vLLM's ``structured_outputs`` keys; the
OpenAI API's ``response_format`` and named ``tool_choice`` map onto them at the door):

- ``json``: a JSON schema (its JSON text); ``json_object``: any JSON object;
- ``regex``: a regular expression the whole output matches;
- ``choice``: one of a list of strings;
- ``grammar``: a context-free grammar, GBNF (``root ::= ...``) or llguidance's Lark dialect.

The grammar engine is llguidance (its grammars compile in about a millisecond, its parser runs
under fuel limits, so a pathological schema or regex fails in bounded time instead of stalling a
process, and it keeps special tokens out of JSON strings). ``grammar_text`` turns a constraint
into llguidance's grammar; ``check`` compiles it against a tokenizer and raises a ValueError
naming the problem, which the tokenizer worker answers with a 400 before the request reaches
the scheduler. The worker compiles it again for its matchers (engine/worker/grammar.py).
JSON schemas compile with compact whitespace (no free spaces or newlines between tokens): more
of the output is forced, and forced tokens cost no forward pass.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import llguidance

# What a client may send: a schema or grammar of at most this many characters, and choices of
# at most this many strings (each of at most MAX_CHOICE_CHARS).
MAX_SPEC_CHARS = 256 << 10
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# The parser's fuel (llguidance's defaults are sized for interactive use; these bound the
# time one compile or one token's mask may take to tens of milliseconds on a CPU core).
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_items_in_row=2_000,
               max_lexer_states=250_000, max_grammar_size=500_000, verbose_errors=False)


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A constraint on the output: exactly one field set (``kind``)."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF or Lark

    @property
    def kind(self) -> str:
        """The one constraint set; a ValueError when none or several are."""
        kinds = [name for name in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice or grammar; got {', '.join(kinds) or 'none'}")
        return kinds[0]

    def check_sizes(self) -> None:
        """Bounds on what the client sent, before anything compiles it."""
        kind = self.kind
        text = getattr(self, kind) if kind in ("json", "regex", "grammar") else None
        if text is not None and len(text) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} has {len(text):,} characters; at most "
                             f"{MAX_SPEC_CHARS:,} are allowed")
        if kind == "choice":
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice needs 1 to {MAX_CHOICES:,} "
                                 f"strings, got {len(self.choice):,}")
            if any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise ValueError("structured_outputs.choice strings must be non-empty and at "
                                 f"most {MAX_CHOICE_CHARS:,} characters")
        if kind == "json":
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec``."""
    import llguidance

    kind = spec.kind
    compact = {"whitespace_flexible": False}
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=compact)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=compact)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    form = "gbnf" if "::=" in spec.grammar else "lark"
    return llguidance.grammar_from(form, spec.grammar)


def parser_limits() -> llguidance.LLParserLimits:
    import llguidance

    return llguidance.LLParserLimits(**_LIMITS)


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int | None,
                      eos_ids: list[int]) -> llguidance.LLTokenizer:
    """The grammar engine's view of a Hugging Face fast tokenizer (about a second to build):
    ``vocab_size`` is the model's (its logits' width, which may exceed the tokenizer's), every
    id of ``eos_ids`` ends a constrained output once the grammar accepts."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=list(eos_ids) or None)


def check(spec: StructuredOutputs, tokenizer: llguidance.LLTokenizer) -> None:
    """Compile ``spec`` against ``tokenizer``; a ValueError naming the problem if it cannot be."""
    import llguidance

    spec.check_sizes()
    try:
        text = grammar_text(spec)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {exc}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        text, tokenizer, limits=parser_limits())
    if failed:
        why = " ".join(line.strip() for line in messages[0].splitlines() if line.strip()) if (
            messages) else "it does not compile"
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {why[:400]}")
