"""Messages between the scheduler and the model worker (engine/contracts/protocol.py has the
union every socket decodes and the encoding): a step's batch and what the worker reads and
writes beside it (host and disk tier copies), its result, and what the worker tells the
scheduler at start.

    scheduler ──ForwardBatch──▶ worker
    scheduler ◀──BatchResult/WorkerReady── worker
"""

from __future__ import annotations

import msgspec

from engine.contracts.lora import LoraAdapterInfo
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.step import BatchInput


class RowSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    """How to sample one logits row. ``history`` (prompt then output ids) is sent only for rows
    with penalties; ``output_len`` is the seeded step index. A constrained row
    (``params.structured_outputs``) names its sequence in ``grammar_key``: the worker keeps
    that sequence's grammar state between steps (engine/worker/grammar.py)."""

    params: SamplingParams
    output_len: int
    prompt_len: int = 0
    history: bytes = b""
    grammar_key: str = ""


class DiskSave(msgspec.Struct, array_like=True):
    """Write one disk-tier block (engine/contracts/disk_cache.py): its name and its device pages
    (int32), copied out before the step's page writes; empty when only its window is written.
    ``swa``: the sliding pages of its pages (int32), whose KV goes to its window file
    (``disk_blocks.window_name``); empty: no window file."""

    name: str
    pages: bytes
    swa: bytes = b""


class DiskLoad(msgspec.Struct, array_like=True):
    """Read blocks ``names`` (consecutive, in position order) into device ``pages`` (int32,
    block after block) on the worker's I/O thread; a later ``BatchResult.loads_ended`` says how
    many arrived (``loads_ended``)."""

    load_id: int
    names: list[str]
    pages: bytes
    # sliding pages, one per page of ``pages`` (-1: none): a block with any reads its window
    # file into them (the load ends before a block whose window file is missing)
    swa: bytes = b""


class HostLoad(msgspec.Struct, array_like=True):
    """Copy host pages (the host tier's, in the worker's numbering) into device ``pages`` (both
    int32, pair by pair) on the worker's I/O thread; a later ``BatchResult.loads_ended`` says
    it ended (1 unit, or 0 when it failed)."""

    load_id: int
    host_pages: bytes
    pages: bytes


class ForwardBatch(msgspec.Struct, tag=True, kw_only=True):
    """Scheduler → worker: one step (``engine.contracts.step.BatchInput``, its arrays as int32 msgpack
    extensions) and how to sample it.

    Order of work: swap_out, swap_in, copies, forward, then sample one token per ``sampling``
    row (rows of ``step.logits_rows``, which may repeat a row: parallel samples share one
    prefill).
    """

    batch_id: int
    step: BatchInput
    sampling: list[RowSampling]
    # constrained sequences that ended since the last batch: their grammar states are dropped
    released_grammars: list[str] = []
    # prompt logprobs: token rows of ``step`` whose logits are wanted too (int32), the token
    # each row's logprob is taken at (the next prompt token), and how many top logprobs
    prompt_rows: bytes = b""
    prompt_targets: bytes = b""
    prompt_top_n: int = 0
    # the disk tier's blocks to save (copied out first), and loads into sequences' own pages
    # (scheduler/loads.py) to start beside the forward
    disk_saves: list[DiskSave] = []
    disk_loads: list[DiskLoad] = []
    host_loads: list[HostLoad] = []


class BatchResult(msgspec.Struct, tag=True, kw_only=True):
    """Worker → scheduler: one sampled token per sampling row; for constrained rows, the tokens
    their grammar forces after it (``forced_counts`` int32 per row, ``forced_ids`` the tokens
    in row order; empty when none) and the rows whose grammar can take nothing more
    (``grammar_ended``, int32 row numbers: those sequences finish with "stop")."""

    batch_id: int
    token_ids: bytes = b""
    logprobs: bytes = b""
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    forced_counts: bytes = b""
    forced_ids: bytes = b""
    grammar_ended: bytes = b""
    # constrained rows whose grammar did not compile in the worker, (row, why): their requests
    # fail alone (400), the rest of the batch goes on
    grammar_failures: list[tuple[int, str]] = []
    mask_seconds: float = 0.0  # host time the step's token masks took (filled beside the forward)
    transfer_seconds: float = 0.0  # time the step's swaps, write-downs and loads took to issue
    # per ForwardBatch.prompt_rows row: the target's logprob (float32), the top-N ids and logprobs
    prompt_logprobs: bytes = b""
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    top_n: int = 0
    # the draft model's drafts (engine/worker/draft.py): how many for each sequence the step's
    # draft_lens named (int32, batch order; fewer where it was unsure) and the ids, in order
    draft_counts: bytes = b""
    draft_ids: bytes = b""
    # per sequence of the step (int32, batch order): the drafts a constrained verification's
    # grammar kept (engine/worker/grammar_drafts.py), -1 for the others; empty when none
    grammar_drafts: bytes = b""
    error: str | None = None
    # loads ended since the last result, (load id, units that arrived: disk blocks, or 1 for
    # a host load), and the disk tier's running totals
    loads_ended: list[tuple[int, int]] = []
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_load_seconds: float = 0.0
    disk_rejected: int = 0
    disk_off: bool = False  # the disk tier's directory is gone: the scheduler stops using it
    disk_ready: bool = True  # its store is set up (False: a full disk; tried again later)


class ModelInfo(msgspec.Struct, kw_only=True):
    model: str
    architecture: str
    vocab_size: int
    context_len: int
    eos_token_ids: list[int]
    page_size: int
    num_pages: int
    num_host_pages: int  # swap preemption's
    device: str
    dtype: str
    attention_backend: str
    kv_cache_dtype: str = ""  # what the pool stores (--kv-cache-dtype resolved)
    kv_cache_bytes: int = 0  # the device pool's bytes, scales included
    # the weights' bytes by format (a dtype's name, or a block format: q4_1, int8, ...); rank
    # 0's share under tensor parallel
    weight_bytes: dict[str, int] = {}
    # quantized weights' product forms: "format NxK dtype" -> rows ("17-64") -> blocks or
    # widened (engine/worker/model/linear_forms.py); rank 0's under tensor parallel
    linear_forms: dict[str, dict[str, str]] = {}
    num_host_cache_pages: int = 0  # the prefix cache's host tier (after the swap pages)
    # the sliding-window layers' own pages (--sliding-kv-ratio; 0: they keep full KV in the
    # pages above) and the window they see
    num_sliding_pages: int = 0
    sliding_window: int = 0
    num_host_cache_sliding_pages: int = 0  # the host tier's windows (after swap's)
    disk_fingerprint: str = ""  # the disk tier's directory for this model and layout, if on
    disk_block_tokens: int = 0
    disk_ready: bool = False  # its store is set up (not after a full disk at start)
    lora_adapters: list[LoraAdapterInfo] = []  # loaded at start (--lora-modules)
    max_loras: int = 0  # adapters one step may use (0: LoRA is off)


class WorkerReady(msgspec.Struct, tag=True):
    info: ModelInfo
