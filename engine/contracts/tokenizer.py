"""The model's tokenizer, loaded the one way every process that needs it does (the tokenizer
workers; the model worker, for the grammar engine's view of the vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer. A ``tokenizer.json`` loads as the fast tokenizer directly, the
    class transformers' AutoTokenizer picks for it too, without importing torch (AutoTokenizer
    does: about 6 s of CPU on every start); other layouts go through AutoTokenizer."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
