"""radixserve engine: front doors, launcher, protocol, GPU worker.

Heavy names (``Engine``) are imported lazily so that ``engine.contracts.protocol`` stays importable
without torch by the scheduler and tokenizer processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.contracts.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.runtime.offline import Completion, Engine, RequestResult

__all__ = ["Completion", "Engine", "RequestResult", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("Completion", "Engine", "RequestResult"):
        from engine.runtime import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
