"""``--speculative-config``: speculative decoding with no draft model, in vLLM's JSON keys.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'

``ngram`` drafts the tokens that followed the latest earlier occurrence of the sequence's last
``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens in its own prompt and output (prompt
lookup, scheduler/ngram.py). The scheduler verifies a sequence's drafts in one step
(scheduler/speculation.py) and stops drafting where it does not pay: for a sequence whose
drafts are mostly rejected, and while more than ``disable_by_batch_size`` sequences run (the
step is then bound by compute, not by reading the weights, and a draft costs as much as a
token).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# scripts/bench_speculation.py --cost, SmolLM2-135M on a shared 2-core CPU, one thread, 300
# cached tokens a sequence: a verify step with 5 drafts a sequence costs 1.4-2.1x a decode
# step of the same batch up to 16 sequences (one accepted draft in a verify pays for it) and
# 2.6x at 32, where the step is bound by compute. Noisy (others' jobs ran meanwhile).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The parsed ``--speculative-config``; ``parse`` fills vLLM's defaults and checks it."""

    method: Literal["ngram"]
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=16)]
    prompt_lookup_min: Annotated[int, Meta(ge=1)] | None = None
    prompt_lookup_max: Annotated[int, Meta(ge=1)] | None = None
    disable_by_batch_size: Annotated[int, Meta(ge=1)] = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config ``text`` (JSON) describes; ValueError with a sentence if it is not one."""
        try:
            config = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--speculative-config must be a JSON object such as "
                             f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': "
                             f"{exc}") from None
        except msgspec.ValidationError as exc:
            raise ValueError(f"--speculative-config is not valid: {exc}") from None
        # vLLM's rule: one bound given sets the other; neither sets both to 5.
        if config.prompt_lookup_min is None and config.prompt_lookup_max is None:
            config.prompt_lookup_min = config.prompt_lookup_max = 5
        elif config.prompt_lookup_min is None:
            config.prompt_lookup_min = config.prompt_lookup_max
        elif config.prompt_lookup_max is None:
            config.prompt_lookup_max = config.prompt_lookup_min
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min "
                             f"({config.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({config.prompt_lookup_max})")
        return config
