"""``--speculative-config``: speculative decoding, in vLLM's JSON keys.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    --speculative-config '{"method": "suffix", "num_speculative_tokens": 8}'
    --speculative-config '{"model": "small.gguf", "num_speculative_tokens": 4}'

``ngram`` drafts the tokens that followed the latest earlier occurrence of the sequence's last
``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens in its own prompt and output (prompt
lookup, scheduler/ngram.py). ``suffix`` matches the sequence's last tokens (at most
``suffix_decoding_max_tree_depth``) in its own tokens and in every token run the radix cache
holds (other requests' prompts and outputs, same namespace only) and drafts the most frequent
continuation of the longest match (scheduler/suffix.py, scheduler/suffix_index.py): at most
``suffix_decoding_max_spec_factor`` x the match length, while the continuation's estimated
probability stays at least ``suffix_decoding_min_token_prob``; the index covers at most
``suffix_decoding_max_cached_requests`` runs (0: the request's own tokens only). The scheduler
verifies a sequence's drafts in one step (scheduler/speculation.py) and stops drafting where
it does not pay: for a sequence whose drafts are mostly rejected, and while more than
``disable_by_batch_size`` sequences run (the step is then bound by compute, not by reading the
weights, and a draft costs as much as a token).

``model`` (``method`` "draft_model", implied): a smaller model of the same tokenizer drafts,
in the model worker (engine/worker/draft.py), where the suffix method (its keys and defaults)
finds no continuation first; it stops drafting a sequence's step once its own probability of
its next token falls under ``draft_min_token_prob``. Its drafts come from the first
``draft_vocab_size`` token ids (default ``DEFAULT_DRAFT_VOCAB_SIZE``; 0: all of them) and the
ids of the text it read (engine/worker/draft_vocab.py), so that its LM head reads only their
rows; the target verifies each draft, so outputs do not depend on it.
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

# vLLM's defaults for the suffix method's keys
SUFFIX_DEFAULTS = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
MIN_SUFFIX_MATCH = 2  # the shortest match the suffix method drafts from (scheduler/suffix.py)
# A draft model's proposals end where its own probability of its next token falls under this:
# such a draft is accepted less often than it costs (scripts/bench_speculation.py --draft).
DEFAULT_DRAFT_MIN_TOKEN_PROB = 0.4
# The token ids a draft model's drafts come from: the first this many, and those of the text it
# read (engine/worker/draft_vocab.py); its LM head reads only their rows.
DEFAULT_DRAFT_VOCAB_SIZE = 32768


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The parsed ``--speculative-config``; ``parse`` fills vLLM's defaults and checks it."""

    method: Literal["ngram", "suffix", "draft_model"] | None = None
    model: str | None = None  # the draft model (method "draft_model")
    draft_min_token_prob: Annotated[float, Meta(ge=0, le=1)] | None = None
    draft_vocab_size: Annotated[int, Meta(ge=0)] | None = None  # 0: the whole vocabulary
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=16)]
    prompt_lookup_min: Annotated[int, Meta(ge=1)] | None = None
    prompt_lookup_max: Annotated[int, Meta(ge=1)] | None = None
    suffix_decoding_max_tree_depth: Annotated[int, Meta(ge=MIN_SUFFIX_MATCH, le=64)] | None = None
    suffix_decoding_max_cached_requests: Annotated[int, Meta(ge=0)] | None = None
    suffix_decoding_max_spec_factor: Annotated[float, Meta(gt=0)] | None = None
    suffix_decoding_min_token_prob: Annotated[float, Meta(ge=0, le=1)] | None = None
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
        config._check_model()
        draft_keys = ("draft_min_token_prob", "draft_vocab_size")
        others = (*SUFFIX_DEFAULTS, *draft_keys) if config.method == "ngram" else (
            NGRAM_KEYS if config.method == "draft_model" else (*NGRAM_KEYS, *draft_keys))
        given = [key for key in others if getattr(config, key) is not None]
        if given:
            raise ValueError(f"--speculative-config: the {config.method!r} method does not "
                             f"take {', '.join(given)}")
        if config.method == "draft_model" and config.draft_min_token_prob is None:
            config.draft_min_token_prob = DEFAULT_DRAFT_MIN_TOKEN_PROB
        if config.method in ("suffix", "draft_model"):
            for key, default in SUFFIX_DEFAULTS.items():
                if getattr(config, key) is None:
                    setattr(config, key, default)
            return config
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

    def _check_model(self) -> None:
        """``model`` implies the draft_model method, which needs one (ValueError otherwise)."""
        if self.model is not None and self.method in (None, "draft_model"):
            self.method = "draft_model"
        elif self.model is not None:
            raise ValueError(f"--speculative-config: the {self.method!r} method takes no "
                             f"model; drop \"model\" or the method")
        elif self.method is None:
            raise ValueError("--speculative-config needs a \"method\" (ngram or suffix) or "
                             "a draft \"model\"")
        elif self.method == "draft_model":
            raise ValueError("--speculative-config: the draft_model method needs the draft's "
                             "\"model\" (a checkpoint directory or a .gguf file)")

    def check_serving(self, tp_size: int) -> None:
        """ValueError with a sentence for an option a draft model does not run with: its KV
        pages are not sharded over tensor-parallel ranks (the host and disk tiers carry them
        with the model's: engine/worker/draft_tiers.py)."""
        if self.model is not None and tp_size > 1:
            raise ValueError("--speculative-config: a draft model does not run with --tp-size "
                             "above 1 (its KV is not sharded over the ranks)")
