"""Linear layers whose weights stay in a block format (engine/checkpoints/quant_formats.py) and
are read by the compiled kernels (engine/worker/csrc/quant_linear.cpp).

A decode step reads every weight once for a handful of rows, so its cost is the bytes read:
4.5 to 9 bits a weight here (quant_formats.py) against bf16's 16. The kernel quantizes the activations per block
of 32 and multiplies integers. A prefill chunk's rows may instead take the weight widened into a
reused scratch and oneDNN's bf16 GEMM (AMX tiles where the CPU has them), or a bf16 copy of
the weight kept beside the blocks for that GEMM (a model whose copies fit
``--resident-weights-gb``), where that is timed faster at load
(engine/worker/model/linear_forms.py, which says what that costs a row's independence of its
batch). Nothing else dense is kept.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from engine.checkpoints.quant_formats import (
    BITS,
    BLOCK,
    PARTS,
    PackedWeight,
    weights_per_column,
)
from engine.worker.cpu_kernels import quant_ops
from engine.worker.model.linear_forms import MEASURED_ROWS, Scratch, bucket, form_product
from engine.worker.model.parallel import Slice

# int8 digits of the activations against each weight width: against 8-, 6- and 5-bit weights
# one digit's rounding would be most of what they lose, so they get a second
# (csrc/quant_linear.cpp).
DIGITS = {8: 2, 6: 2, 5: 2, 4: 1}


class QuantizedLinear:
    """``[N, K]`` weight in format ``fmt``. Its parts in the checkpoint's layout are allocated
    for the loader to fill; ``repack`` then lays them out for the kernel once and frees them."""

    def __init__(self, fmt: str, rows: int, cols: int, device: torch.device) -> None:
        if cols % BLOCK:
            raise ValueError(f"a {rows} x {cols} weight (under tensor parallel, this rank's "
                             f"share) cannot be held in {fmt}: its rows are not whole blocks of "
                             f"{BLOCK}; choose another --tp-size or use --quantization none")
        self.ops = quant_ops()
        if self.ops is None:
            raise RuntimeError(f"{fmt} weights need the compiled CPU kernels, which are not "
                               "available here (see the log); use --quantization none")
        bits = BITS[fmt]
        self.format, self.rows, self.cols, self.bits = fmt, rows, cols, bits
        self.digits = DIGITS[bits]
        # the form of each row-count bucket, the widened form's buffer and the resident form's
        # copy: (weight, its dtype, laid out for oneDNN) (linear_forms.py)
        self._calls: tuple | None = None  # each bucket's product, bound (``_bind``)
        self.forms: tuple[str, ...] = ("blocks",) * len(MEASURED_ROWS)
        self.scratch: Scratch | None = None
        self.resident: tuple[torch.Tensor, torch.dtype, bool] | None = None
        self.packed: PackedWeight | None = PackedWeight.empty(fmt, rows, cols, device)
        # values, scales, minimums, super-block scales (csrc/quant_linear.cpp)
        self.kernel: tuple[torch.Tensor, ...] | None = None
        self._all_rows = torch.arange(rows, device=device)

    @property
    def forms(self) -> tuple[str, ...]:
        return self._forms

    @forms.setter
    def forms(self, value: tuple[str, ...]) -> None:
        self._forms, self._calls = tuple(value), None

    @property
    def resident(self) -> tuple[torch.Tensor, torch.dtype, bool] | None:
        return self._resident

    @resident.setter
    def resident(self, value: tuple[torch.Tensor, torch.dtype, bool] | None) -> None:
        self._resident, self._calls = value, None

    def _bind(self) -> tuple:
        """Each bucket's product as one callable (``form_product``), made once after the
        forms or the resident copy change rather than chosen again at every call."""
        self._calls = tuple(form_product(self, form) for form in self.forms)
        return self._calls

    @property
    def nbytes(self) -> int:
        held = self.kernel if self.kernel is not None else self.packed.parts().values()
        return sum(t.numel() * t.element_size() for t in held)

    def bytes_by_format(self) -> dict[str, int]:
        """The blocks' bytes, and the resident copy's under its dtype's name."""
        found = {self.format: self.nbytes}
        if self.resident is not None:
            _, dtype, _ = self.resident
            found[str(dtype).removeprefix("torch.")] = self.rows * self.cols * dtype.itemsize
        return found

    def parts(self, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Each part's rows ``rows``: the loader's targets for one checkpoint tensor."""
        return {part: tensor[rows] for part, tensor in self.packed.parts().items()}

    def repack(self) -> None:
        """The loaded blocks in the kernel's layout (csrc/quant_linear.cpp), once."""
        self.kernel = tuple(self.ops.quant_repack(*self.packed.repack_args()))
        self.packed = None

    def rows_dense(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dense matrix (an embedding lookup), widened to ``dtype``."""
        return self.ops.dequantize_weight(*self.kernel, self.bits, self.rows,
                                          ids.to(torch.int64).contiguous(), dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows_dense(self._all_rows, dtype)

    def first_rows(self, rows: int) -> QuantizedLinear:
        """The layer of this weight's first ``rows`` rows (a draft model's LM head over its
        first token ids): the same blocks, read only as far as their row groups reach."""
        view = copy.copy(self)
        groups = -(-rows // self.kernel[1].shape[-1])  # kRows interleaved rows a group
        view.kernel = tuple(t[:groups] if t.numel() else t for t in self.kernel)
        view.rows, view.resident = rows, None  # clears the copied bound products too
        view.forms = tuple("blocks" if form == "resident" else form for form in self.forms)
        view._all_rows = self._all_rows[:rows]
        return view

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), in x's dtype, in the form chosen for x's row count."""
        out = (self._calls or self._bind())[bucket(x.shape[0])](self, x.contiguous())
        return out if bias is None else out.add_(bias)


class MixedQuantizedLinear:
    """A fused projection (q/k/v, gate/up) whose parts a checkpoint holds in different formats
    (a Q4_K_M GGUF's Q4_K queries and keys beside Q6_K values): one ``QuantizedLinear`` for
    each run of consecutive parts that share a format, all over the same input, their outputs
    side by side in the fused order. Each output row is the kernel's alone, so the result is
    what each part's blocks give by themselves::

        rows  [0, q)     [q, q + kv)   [q + kv, q + 2 kv)
        part  q          k             v
        run   q4_k ------------------  q6_k
    """

    def __init__(self, formats: Sequence[str], rows: Sequence[int], cols: int,
                 device: torch.device) -> None:
        runs: list[tuple[str, int]] = []
        for fmt, part_rows in zip(formats, rows, strict=True):
            if runs and runs[-1][0] == fmt:
                runs[-1] = (fmt, runs[-1][1] + part_rows)
            else:
                runs.append((fmt, part_rows))
        self.runs = [QuantizedLinear(fmt, run_rows, cols, device) for fmt, run_rows in runs]
        self.starts = [0]
        for run in self.runs:
            self.starts.append(self.starts[-1] + run.rows)
        self.rows = self.starts[-1]
        # what tier_io's fingerprint records for this weight
        self.format = "+".join(fmt for fmt, _ in runs)

    @property
    def nbytes(self) -> int:
        return sum(run.nbytes for run in self.runs)

    def bytes_by_format(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for run in self.runs:
            for name, size in run.bytes_by_format().items():
                found[name] = found.get(name, 0) + size
        return found

    def parts(self, rows: slice = slice(None)) -> dict[str, torch.Tensor]:
        """Each part's rows ``rows`` of the fused matrix, which lie in one run (a checkpoint
        tensor's)."""
        start, stop, _ = rows.indices(self.rows)
        for run, first, end in zip(self.runs, self.starts, self.starts[1:], strict=False):
            if first <= start and stop <= end:
                return run.parts(slice(start - first, stop - first))
        raise ValueError(f"rows {start}:{stop} span more than one format of {self.format}")

    def repack(self) -> None:
        for run in self.runs:
            run.repack()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), in x's dtype: the runs' products, concatenated."""
        x = x.contiguous()
        out = torch.cat([run(x) for run in self.runs], dim=1)
        return out if bias is None else out.add_(bias)


def quantized_linear(formats: Sequence[str], rows: Sequence[int], cols: int,
                     device: torch.device) -> QuantizedLinear | MixedQuantizedLinear:
    """A weight of parts ``rows`` rows each (stacked, ``cols`` wide) in ``formats`` (one per
    part): one block layer where the parts share a format, else one per run of them."""
    if len(set(formats)) == 1:
        return QuantizedLinear(formats[0], sum(rows), cols, device)
    return MixedQuantizedLinear(formats, rows, cols, device)


def part_sources(name: str, source: Slice, fmt: str) -> dict[str, Slice]:
    """Tensor parallel's slice of weight ``name`` (elements of [N, K]) as slices of its parts.
    A column slice keeps whole blocks: its width is this rank's share, which the layer checked
    to be whole blocks, so every rank's start is too."""
    if source.dim == 0:
        return {f"{name}.{part}": source for part in PARTS}
    return {f"{name}.{part}": Slice(1, source.start // width, source.stop // width,
                                    source.full // width)
            for part, width in weights_per_column(fmt).items()}
