"""Whether a request can ever be admitted: each refusal is a status and a sentence that names
the numbers (the parameter, the prompt, the model's context, the pool), decided once, when the
request arrives."""

from __future__ import annotations

from engine.contracts.engine_config import EngineConfig
from engine.contracts.worker_messages import ModelInfo
from radix import PageAllocator
from scheduler.request import Request


def reject_reason(req: Request, config: EngineConfig, info: ModelInfo, alloc: PageAllocator,
                  num_waiting: int) -> tuple[int, str] | None:
    """(HTTP-like status, message) when ``req`` must be refused, else None."""
    p = req.params
    try:
        p.validate(vocab_size=info.vocab_size, context_len=info.context_len)
    except ValueError as exc:
        return 400, str(exc)
    if req.prompt_len == 0:
        return 400, "the prompt is empty"
    if int(req.prompt_ids.min()) < 0 or int(req.prompt_ids.max()) >= info.vocab_size:
        return 400, f"prompt token ids must be in [0, {info.vocab_size})"
    context = info.context_len
    if req.prompt_len + p.max_tokens > context:
        return 400, (f"the prompt has {req.prompt_len:,} tokens and max_tokens is "
                     f"{p.max_tokens:,}, but the model's context is {context:,} tokens")
    width = max(p.n, p.beam_width)
    if width > config.max_running_requests:
        return 400, (f"the request runs {width:,} sequences (n / beam width) but the server "
                     f"runs at most {config.max_running_requests:,} at once")
    need = (alloc.pages_for(req.prompt_len)
            + width * (alloc.pages_for(p.max_tokens) + 1))
    if need > alloc.num_pages:
        return 400, (f"the request needs up to {need:,} KV pages ({width} sequence(s) of "
                     f"{req.prompt_len:,} + {p.max_tokens:,} tokens) but the KV pool has "
                     f"{alloc.num_pages:,}")
    if num_waiting >= config.max_waiting_requests:
        return 503, (f"the queue is full ({config.max_waiting_requests:,} waiting "
                     "requests); retry later")
    return None
