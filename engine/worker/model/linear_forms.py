"""How a quantized linear layer (engine/worker/model/quant.py) computes x @ W.T, by the call's
row count. Three forms read the same blocks:

- ``blocks``: the block kernel (csrc/quant_linear.cpp): activations quantized to int8 per
  block of 32, integer products (AVX-512 VNNI, AVX2). It reads 4.5-9 bits a weight, which is
  what a decode step's few rows cost; each output row is its own row's alone, whatever the
  batch (a verify row equals its decode row).
- ``widened``: the weight widened (csrc/quant_widen.cpp) into one scratch buffer that every
  layer reuses, a tile of output rows at a time, and multiplied by oneDNN's GEMM: in bf16 when
  the activations are (AMX tiles on CPUs that have them), else float32. Widening is a pass over
  the weight, which a prefill chunk's hundreds of rows repay many times over.
- ``resident``: the same widened weight kept beside the blocks (dequantize_weight's numbers,
  laid out once for oneDNN where it runs bf16), so the GEMM runs without the widening pass: what
  a step of a few dozen rows (a question over a cached head beside decoding sequences) cannot
  repay. It costs the weight's bytes in bf16 again, so ``auto`` offers it only to bf16
  activations on a CPU whose oneDNN runs bf16, in a model whose copies fit in
  ``resident_bytes`` (``--resident-weights-gb``), never to the LM head (it
  multiplies a row or two per sequence), and only from ``RESIDENT_MIN_ROWS`` rows: load-time
  timing runs on a warm cache, where a decode step's read of the copy (16 bits a weight
  against the blocks' 4.5-9) would look cheaper than it is. A layer whose measured choices
  never take it frees its copy.

Which is faster depends on the CPU, the weight's format and shape, and the rows, so every
distinct weight (format, rows, columns) is timed in each form it may take at load at each of
``MEASURED_ROWS``; a call takes the choice of the measured count nearest its own (``bucket``).
The choices are cached beside the converted checkpoint in ``linear_forms.json``, under a key of
the CPU's model name, the thread count, torch's version, the kernels' loops and whether the
resident form was offered, so a later start reads them instead of timing again.

A row's result depends on the form (the widened product rounds the weights to bf16 and keeps
the activations; the block kernel quantizes the activations), so where the buckets choose
differently a row computed alone differs by rounding from the same row in a larger call
(``widened`` and ``resident`` multiply the same numbers; oneDNN may order the sums apart).
``EngineConfig.linear_form`` (``--linear-form``) ``blocks`` pins the block kernel for every
bucket, which keeps each row independent of the batch; ``widened`` and ``resident`` pin the
others (tests: any CPU runs them, in float32 where oneDNN has no bf16).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.checkpoints.artifact_cache import update_json

logger = logging.getLogger("radixserve.worker")

FORMS = ("blocks", "widened", "resident")
POLICIES = ("auto", *FORMS)
# Row counts timed at load; a call of M rows takes the choice of the nearest one (in ratio).
MEASURED_ROWS = (1, 8, 32, 128, 512)
_UPPER = tuple(int((a * b) ** 0.5) for a, b in zip(MEASURED_ROWS, MEASURED_ROWS[1:],
                                                     strict=False))  # 2, 16, 64, 256
CACHE_FILE = "linear_forms.json"
# The scratch a widened weight is written to, at most (larger ones go a tile of rows at a time).
TILE_BYTES = 32 << 20
_REPEATS = 3
_BUDGET = 0.05  # seconds of timed runs of one form at one row count, after which it stops
RESIDENT_MIN_ROWS = 17  # ``auto`` times the resident form from this many rows (bucket 17-64)


def bucket(rows: int) -> int:
    """The index into ``MEASURED_ROWS`` whose choice a call of ``rows`` rows takes."""
    return bisect.bisect_left(_UPPER, rows)


def bucket_label(index: int) -> str:
    """The rows a bucket covers, as the log and /metrics show it: ``1-2``, ``257+``."""
    low = 1 if index == 0 else _UPPER[index - 1] + 1
    return f"{low}+" if index == len(_UPPER) else f"{low}-{_UPPER[index]}"


class Scratch:
    """One buffer that every widened layer of a model writes its weight tile into: only one
    product runs at a time in a worker (its forward is one thread's), so one suffices."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        size = rows * cols * dtype.itemsize
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer[:size].view(dtype).view(rows, cols)


def widened_dtype(x: torch.Tensor) -> torch.dtype:
    """bf16 for bf16 activations on a CPU whose oneDNN runs it natively, else float32."""
    if x.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def widened_product(ops: object, blocks: tuple[torch.Tensor, ...], bits: int, rows: int,
                    cols: int, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """x @ W.T in x's dtype, W (``rows`` x ``cols``, quant_repack's ``blocks``) widened into
    ``scratch`` a tile of whole row groups at a time."""
    dtype = widened_dtype(x)
    xw = x if x.dtype == dtype else x.to(dtype)
    group = blocks[1].shape[-1]  # output rows interleaved in one group (scales' last dim)
    tile = max(group, TILE_BYTES // (cols * dtype.itemsize) // group * group)
    if rows <= tile:
        weight = scratch.take(rows, cols, dtype)
        ops.widen_weight(list(blocks), bits, rows, weight)
        return torch.mm(xw, weight.t()).to(x.dtype)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    for first in range(0, rows, tile):
        count = min(tile, rows - first)
        groups = slice(first // group, (first + count + group - 1) // group)
        weight = scratch.take(count, cols, dtype)
        ops.widen_weight([t[groups] for t in blocks], bits, count, weight)
        out[:, first:first + count] = torch.mm(xw, weight.t())
    return out


def make_resident(layer: object, dtype: torch.dtype) -> None:
    """Keep ``layer``'s weight widened beside its blocks for activations of ``dtype``: bf16
    laid out for oneDNN where it runs bf16, else a plain float32 matrix."""
    wide = widened_dtype(torch.empty(0, dtype=dtype))
    dense = layer.dense(wide)
    if wide == torch.bfloat16:
        layer.resident = (torch.ops.mkldnn._reorder_linear_weight(dense), wide, True)
    else:
        layer.resident = (dense, wide, False)


def linear_pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x @ W.T (+ bias) over ``packed``, W laid out for oneDNN (``_reorder_linear_weight``):
    the op's overload named, which saves the ~12 us a call that resolving it among the packet's
    overloads costs (SmolLM2's 120 products a step: ~1.4 ms)."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def resident_product(layer: object, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T from ``layer``'s resident copy (``make_resident``), in x's dtype."""
    weight, dtype, packed = layer.resident
    xw = x if x.dtype == dtype else x.to(dtype)
    if packed:
        out = linear_pointwise(xw, weight)
    else:
        out = torch.mm(xw, weight.t())
    return out if out.dtype == x.dtype else out.to(x.dtype)


def resident_nbytes(layer: object) -> int:
    """What ``layer``'s resident copy holds in bf16 (the only copies ``auto`` makes)."""
    return layer.rows * layer.cols * torch.bfloat16.itemsize


def product(layer: object, x: torch.Tensor, form: str) -> torch.Tensor:
    """x @ W.T of ``layer`` (a QuantizedLinear) in ``form``."""
    if form == "resident":
        return resident_product(layer, x)
    if form == "widened":
        return widened_product(layer.ops, layer.kernel, layer.bits, layer.rows, layer.cols, x,
                               layer.scratch)
    return layer.ops.quant_linear(x, *layer.kernel, layer.bits, layer.rows, layer.digits)


def form_product(layer: object, form: str) -> Callable[[object, torch.Tensor], torch.Tensor]:
    """``product(layer, x, form)`` as one callable of (layer, x), what a layer's forward calls
    for each bucket (``QuantizedLinear._bind``): for the resident copy laid out for oneDNN,
    its product straight where x is in its dtype. It holds no reference to ``layer``."""
    if form == "resident" and layer.resident is not None and layer.resident[2]:
        weight, dtype, _ = layer.resident
        return functools.partial(_resident_packed, weight, dtype)
    return functools.partial(product, form=form)


def _resident_packed(weight: torch.Tensor, dtype: torch.dtype, layer: object, x: torch.Tensor
                     ) -> torch.Tensor:
    if x.dtype == dtype:
        return linear_pointwise(x, weight)
    return resident_product(layer, x)


def can_widen(layer: object, dtype: torch.dtype) -> bool:
    """Whether the widening kernel reads ``layer``'s blocks as dequantize_weight does: its first
    row group widened, compared bit for bit (a layout it does not know is refused)."""
    wide = widened_dtype(torch.empty(0, dtype=dtype))
    count = min(layer.rows, layer.kernel[1].shape[-1])
    out = torch.empty(count, layer.cols, dtype=wide)
    try:
        layer.ops.widen_weight([t[:1] for t in layer.kernel], layer.bits, count, out)
    except RuntimeError as exc:
        logger.warning("%s blocks stay in the block kernel: the widening kernel refused them "
                       "(%s)", layer.format, str(exc).splitlines()[0])
        return False
    if not torch.equal(out, layer.rows_dense(torch.arange(count), wide)):
        logger.warning("%s blocks stay in the block kernel: widened, they differ from "
                       "dequantize_weight's rows", layer.format)
        return False
    return True


def pin(layer: object, form: str, dtype: torch.dtype) -> list[str]:
    """``layer`` computes in ``form`` at every row count (``widened`` where the widening
    kernel reads its blocks; ``resident`` copies dequantize_weight's)."""
    if form == "widened" and not can_widen(layer, dtype):
        raise ValueError(f"--linear-form widened: {layer.format} blocks of a {layer.rows} x "
                         f"{layer.cols} weight cannot be widened here (see the log); use auto "
                         "or blocks")
    layer.resident = None
    if form == "resident":
        make_resident(layer, dtype)
    layer.forms = (form,) * len(MEASURED_ROWS)
    return list(layer.forms)


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cache_key(isa: str, resident: bool) -> str:
    """What the timings depend on besides the weights: the CPU (its model and features), the
    threads, torch (oneDNN), the block kernel's loops and whether the resident form competed."""
    parts = [cpu_name(), _cpuinfo("flags"), str(torch.get_num_threads()), torch.__version__, isa]
    if resident:
        parts.append("resident")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _seconds(run: object, warm: bool) -> float:
    """The best of up to ``_REPEATS`` runs, fewer once they have taken ``_BUDGET`` seconds (a
    large LM head's products take tens of milliseconds each)."""
    if warm:
        run()  # the scratch allocated, oneDNN's kernel chosen and compiled
    best, spent = float("inf"), 0.0
    for _ in range(_REPEATS):
        start = time.perf_counter()
        run()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > _BUDGET:
            break
    return best


def measure(layer: object, dtype: torch.dtype) -> list[str]:
    """The faster form of ``layer`` (a QuantizedLinear) at each of ``MEASURED_ROWS``, with
    activations of ``dtype``: the block kernel against the widened form, or from
    ``RESIDENT_MIN_ROWS`` rows against the resident one where ``layer`` holds a copy (the same
    GEMM without the widening, which the widened form cannot beat). Once a widened weight wins,
    the larger counts take it untimed: the block kernel's cost grows with the rows faster."""
    choices: list[str] = []
    generator = torch.Generator().manual_seed(0)
    for rows in MEASURED_ROWS:
        other = ("resident" if layer.resident is not None and rows >= RESIDENT_MIN_ROWS
                 else "widened")
        if choices and choices[-1] == other:
            choices.append(other)
            continue
        x = torch.randn(rows, layer.cols, generator=generator).to(dtype)
        blocks = _seconds(lambda x=x: product(layer, x, "blocks"), warm=False)
        seconds = _seconds(lambda x=x, other=other: product(layer, x, other), warm=True)
        choices.append(other if seconds < blocks else "blocks")
    return choices


def _quantized_layers(model: torch.nn.Module) -> Iterator[tuple[str, object]]:
    """(name, QuantizedLinear) for every block layer of ``model``, a mixed projection's runs
    each, the LM head once even where it shares the embedding's blocks."""
    seen: set[int] = set()
    for module in model.modules():
        for name, layer in getattr(module, "quantized", {}).items():
            if name == "embed":
                continue  # read by rows (embedding lookups), never multiplied
            for run in getattr(layer, "runs", [layer]):
                if id(run) not in seen:
                    seen.add(id(run))
                    yield name, run


def signature(layer: object, dtype: torch.dtype) -> str:
    """What a weight's timings depend on: format, shape, the activations' dtype."""
    return f"{layer.format} {layer.rows}x{layer.cols} {str(dtype).removeprefix('torch.')}"


def choose_forms(model: torch.nn.Module, policy: str, dtype: torch.dtype,
                 cache_dir: Path | None, resident_bytes: int = 0) -> dict[str, dict[str, str]]:
    """Set every quantized layer's form per bucket under ``policy`` (``POLICIES``): ``auto``
    reads the choices cached in ``cache_dir`` (the converted checkpoint's directory) for this
    CPU, or times each distinct weight and caches them there, offering the resident form when
    the copies of all the layers but the LM head fit in ``resident_bytes``. Returns signature
    -> bucket (``bucket_label``) -> form, which the worker logs and reports (/metrics)."""
    if policy not in POLICIES:
        raise ValueError(f"linear_form must be one of {', '.join(POLICIES)}, got {policy!r}")
    # the LM head multiplies float32 rows (its logits stay float32), the others ``dtype`` ones
    layers = [(name, layer, torch.float32 if name == "lm_head" else dtype)
              for name, layer in _quantized_layers(model)]
    if not layers:
        return {}
    scratch = Scratch()
    for _, layer, _ in layers:
        layer.scratch, layer.resident = scratch, None
    table: dict[str, list[str]] = {}
    names: dict[str, set[str]] = {}
    for name, layer, x_dtype in layers:
        names.setdefault(signature(layer, x_dtype), set()).add(name)
    if policy != "auto":
        for _, layer, x_dtype in layers:
            table[signature(layer, x_dtype)] = pin(layer, policy, x_dtype)
        return _labelled(table)
    isa = layers[0][1].ops.quant_linear_isa()
    # copies in bf16 only: float32 activations (or no bf16 in oneDNN) keep the two other forms
    bf16 = widened_dtype(torch.empty(0, dtype=dtype)) == torch.bfloat16
    offered = [layer for name, layer, _ in layers if name != "lm_head"]
    resident = bf16 and 0 < sum(resident_nbytes(layer) for layer in offered) <= resident_bytes
    key = cache_key(isa, resident)
    cached = _read_cache(cache_dir, key) if cache_dir is not None else {}
    start = time.perf_counter()
    timed = 0
    for name, layer, x_dtype in layers:
        sig = signature(layer, x_dtype)
        if sig not in table:
            if sig in cached:
                table[sig] = cached[sig]
            elif can_widen(layer, x_dtype):
                if resident and name != "lm_head":
                    make_resident(layer, x_dtype)
                table[sig] = measure(layer, x_dtype)
                timed += 1
            else:
                table[sig] = ["blocks"] * len(MEASURED_ROWS)
        layer.forms = tuple(table[sig])
        if "resident" not in layer.forms:
            layer.resident = None
        elif layer.resident is None:
            make_resident(layer, x_dtype)
    seconds = time.perf_counter() - start
    shown = "; ".join(f"{'/'.join(sorted(names[sig]))} {sig}: " + ", ".join(
        f"{bucket_label(i)} {form}" for i, form in enumerate(forms))
        for sig, forms in table.items())
    if timed:
        logger.info("linear forms by rows, %d weights timed in %.2f s on %s, %d threads: %s",
                    timed, seconds, cpu_name(), torch.get_num_threads(), shown)
        if cache_dir is not None:
            _write_cache(cache_dir, key, table, seconds, isa)
    else:
        logger.info("linear forms by rows (cached for %s, %d threads): %s", cpu_name(),
                    torch.get_num_threads(), shown)
    return _labelled(table)


def _labelled(table: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    return {sig: {bucket_label(i): form for i, form in enumerate(forms)}
            for sig, forms in table.items()}


def _read_cache(cache_dir: Path, key: str) -> dict[str, list[str]]:
    import json

    try:
        entry = json.loads((cache_dir / CACHE_FILE).read_text()).get(key, {})
    except (OSError, ValueError):
        return {}
    forms = entry.get("forms", {}) if isinstance(entry, dict) else {}
    return {sig: list(choice) for sig, choice in forms.items()
            if isinstance(choice, list) and len(choice) == len(MEASURED_ROWS)
            and all(form in FORMS for form in choice)}


def _write_cache(cache_dir: Path, key: str, table: dict[str, list[str]], seconds: float,
                 isa: str) -> None:
    def change(data: dict) -> None:
        entry = data.setdefault(key, {"cpu": cpu_name(), "threads": torch.get_num_threads(),
                                      "torch": torch.__version__, "kernels": isa,
                                      "rows": list(MEASURED_ROWS), "forms": {}})
        entry["forms"].update(table)
        entry["measured_seconds"] = round(seconds, 3)

    try:
        update_json(cache_dir / CACHE_FILE, change)
    except OSError as exc:
        logger.info("linear forms not cached (%s: %s): they are timed again at each start",
                    type(exc).__name__, exc)
