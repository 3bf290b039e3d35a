"""What a request asks of decoding (``SamplingParams``), its limits and their validation: the
frontends check a request with ``validate()`` before it goes on, so a bad value fails with a
sentence naming the field (``InvalidParam``), never inside the engine."""

from __future__ import annotations

import msgspec

from engine.contracts.structured import StructuredOutputs


class InvalidParam(ValueError):
    """A sampling parameter out of range: ``field`` names it, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a request asks of decoding. Validate with ``validate()`` before admitting."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = 1
    beam_width: int = 1  # > 1: beam search (deterministic, length-normalised like transformers)
    length_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled token's)
    # top-N logprobs of every prompt token after the first (0: only the token's own); the
    # prompt is computed whole for them (no prefix-cache hit: cached positions have no logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # a constraint on the output (engine/contracts/structured.py); compiled and checked against
    # the tokenizer by the tokenizer worker, enforced by the worker's sampler
    structured_outputs: StructuredOutputs | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, *, vocab_size: int | None = None, context_len: int | None = None) -> None:
        """Raise InvalidParam (a ValueError) naming the field, with a sentence a user can act on.

        Every number is checked against what the engine can represent: token ids and counts
        travel as int32, seeds as uint64, and floats must be finite (a NaN fails every range
        test below). With ``vocab_size`` and ``context_len`` (the door and the scheduler know
        them) ids and lengths are checked against the model too."""
        limit = context_len or INT32_MAX
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got "
                               f"{show_int(self.max_tokens)}")
        if self.max_tokens > limit:
            raise InvalidParam("max_tokens", f"max_tokens is {show_int(self.max_tokens)}, but the "
                               f"model's context is {limit:,} tokens")
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidParam("temperature",
                               f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT32_MAX:
            raise InvalidParam("top_k", f"top_k must be -1 or 0 (disabled) or a positive integer "
                               f"up to {INT32_MAX:,}, got {show_int(self.top_k)}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be in (0, 10], "
                               f"got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise InvalidParam("seed", f"seed must be in [0, 2**64), got {show_int(self.seed)}")
        for name, low, high in (("n", 1, 128), ("beam_width", 1, 32), ("logprobs", 0, 20),
                                ("prompt_logprobs", 0, 20)):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise InvalidParam(name, f"{name} must be between {low} and {high}, got "
                                   f"{show_int(value)}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise InvalidParam("n", f"n ({self.n}) cannot exceed beam_width ({self.beam_width})")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise InvalidParam("length_penalty", f"length_penalty must be in "
                               f"[-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got "
                               f"{self.length_penalty}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                               f"got {len(self.stop):,}")
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must not be empty")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise InvalidParam("stop", f"stop strings may have at most {MAX_STOP_CHARS:,} "
                               f"characters, one has {longest:,}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParam("stop_token_ids", f"stop_token_ids may hold at most "
                               f"{MAX_STOP_TOKEN_IDS:,} ids, got {len(self.stop_token_ids):,}")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.check_sizes()
            except ValueError as exc:
                raise InvalidParam("structured_outputs", str(exc)) from None
            if self.beam_width > 1:
                raise InvalidParam("structured_outputs", "beam search cannot be combined with "
                                   "structured output (a grammar state per beam is not kept)")
        id_limit = vocab_size or INT32_MAX + 1
        bad = [t for t in self.stop_token_ids if not 0 <= t < id_limit]
        if bad:
            where = f"the vocabulary (size {vocab_size:,})" if vocab_size else "[0, 2**31)"
            raise InvalidParam("stop_token_ids",
                               f"stop_token_ids {show_int(bad[0])} is outside {where}")


INT32_MAX = (1 << 31) - 1  # token ids, counts and lengths travel as int32
SEED_LIMIT = 1 << 64  # seeds travel as uint64; derived seeds (seed + sample index) wrap modulo it
# Beam scores divide by length ** length_penalty; past ~10 the length term swamps any logprob
# difference anyway, and |penalty| <= 10 keeps that power finite in float64 for any context.
MAX_LENGTH_PENALTY = 10.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # each stop string is matched against every new text delta
MAX_STOP_TOKEN_IDS = 1024  # the list rides on every step's batch message


def show_int(value: int) -> str:
    """A number for an error sentence; a 400-digit seed is described, not printed."""
    text = f"{value:,}"
    return text if len(text) <= 32 else f"a {len(str(abs(value)))}-digit number"
