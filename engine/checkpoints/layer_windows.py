"""Which layers of a model see a sliding window, and how wide, from its config.json as
transformers derives it; the runner (engine/worker/model/config.py) and the profiler
(engine/profiler/sliding.py) both read it here."""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"


def sliding_windows(raw: dict[str, Any], architecture: str, num_layers: int
                    ) -> tuple[int | None, ...]:
    """Each layer's window, as transformers has it: Mistral windows every layer when
    ``sliding_window`` is set; Qwen2/3 the layers that ``layer_types`` (or
    ``use_sliding_window`` + ``max_window_layers``) mark as sliding; Gemma 3 those
    ``layer_types`` mark, or by default every layer but each sixth
    (``sliding_window_pattern``); Llama never windows."""
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or not window:
        return (None,) * num_layers
    if architecture == "MistralForCausalLM":
        return (int(window),) * num_layers
    return tuple(int(window) if kind == SLIDING else None
                 for kind in layer_types(raw, architecture, num_layers))


def layer_types(raw: dict[str, Any], architecture: str, num_layers: int) -> list[str]:
    """Each layer's kind (``SLIDING`` or ``FULL``), as transformers derives it."""
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if architecture == "Gemma3ForCausalLM":
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                      or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not raw.get("use_sliding_window", False):
        return [FULL] * num_layers
    first = int(raw.get("max_window_layers", 0))
    return [SLIDING if i >= first else FULL for i in range(num_layers)]
