"""Messages shared by every process. msgspec Structs encoded as msgpack; never pickle.

Token ids travel as packed int32 bytes (``pack_ids`` / ``unpack_ids``), never as Python lists.
"""

from __future__ import annotations

import msgspec
import numpy as np


def pack_ids(ids: np.ndarray | list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int32).tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


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
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, *, vocab_size: int | None = None) -> None:
        """Raise ValueError with a sentence a user can act on."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.n < 1 or self.n > 128:
            raise ValueError(f"n must be between 1 and 128, got {self.n}")
        if self.beam_width < 1 or self.beam_width > 32:
            raise ValueError(f"beam_width must be between 1 and 32, got {self.beam_width}")
        if self.beam_width > 1 and self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) cannot exceed beam_width ({self.beam_width})")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not (0 <= t < vocab_size)]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
