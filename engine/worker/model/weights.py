"""The weights' base of every module of the model (engine/worker/model/llama.py): parameters
the loader fills, quantized layers (engine/worker/model/quant.py) and oneDNN's prepacked copies,
and the product of each by its name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.model.linear_forms import linear_pointwise
from engine.worker.model.quant import MixedQuantizedLinear, QuantizedLinear, quantized_linear
from engine.worker.model.row_tiles import in_row_tiles


class Weights(nn.Module):
    """Holds uninitialised, gradient-free parameters; the loader fills every one of them.

    ``prepack`` (CPU, bf16): the matrices named in ``_LINEARS`` are re-laid out once for
    oneDNN (``torch.ops.mkldnn``, the layout inductor's CPU path uses) and ``_linear`` runs them
    there: the same bits as ``F.linear``, at half its per-call cost for the few-row GEMMs of a
    decode step (60 -> 27 us for a batch-8 [576 x 1728] product). The plain copy is freed,
    unless something else reads it (a tied embedding)."""

    _LINEARS: tuple[str, ...] = ()
    # Dense products in calls of exactly this many rows (0: one call): ``pin_row_order``.
    row_tile = 0

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self._factory = dict(device=device, dtype=dtype)
        self.packed: dict[str, torch.Tensor] = {}
        self.quantized: dict[str, QuantizedLinear | MixedQuantizedLinear] = {}

    def _new(self, *shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(shape, **self._factory), requires_grad=False)

    def _matrix(self, name: str, rows: Sequence[int], cols: int,
                formats: Sequence[str] | None) -> None:
        """Weight ``name``, its parts of ``rows`` rows each stacked (q/k/v, gate/up; one part
        elsewhere) into [sum(rows), cols]: a dense parameter, or (``formats``, each part's)
        quantized blocks (engine/worker/model/quant.py), with an empty parameter in its
        place."""
        if formats is None:
            setattr(self, name, self._new(sum(rows), cols))
            return
        self.quantized[name] = quantized_linear(formats, rows, cols, self._factory["device"])
        setattr(self, name, self._new(0))

    def _targets(self, name: str, checkpoint_name: str, rows: slice = slice(None)
                 ) -> dict[str, torch.Tensor]:
        """The loader's targets for checkpoint tensor ``checkpoint_name``, rows ``rows`` of
        weight ``name``: the dense slice, or each quantized part's rows."""
        quantized = self.quantized.get(name)
        if quantized is None:
            return {checkpoint_name: getattr(self, name)[rows]}
        return {f"{checkpoint_name}.{part}": tensor
                for part, tensor in quantized.parts(rows).items()}

    def _linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        quantized = self.quantized.get(name)
        if quantized is not None:
            return quantized(x, bias)
        if self.row_tile and x.shape[0] not in (0, self.row_tile):
            return in_row_tiles(lambda rows: self._linear(name, rows, bias), x, self.row_tile)
        packed = self.packed.get(name)
        if packed is None:
            return F.linear(x, getattr(self, name), bias)
        return linear_pointwise(x, packed, bias)

    def weight_bytes(self) -> dict[str, int]:
        """Resident bytes of this module's weights (its submodules' too) by format: the
        dtype's name for dense ones (oneDNN's prepacked copies included: a tied embedding keeps
        its plain copy beside the LM head's), the block format's for quantized ones."""
        found: Counter[str] = Counter()
        for module in self.modules():
            if not isinstance(module, Weights):
                continue
            for tensor in [*module.parameters(recurse=False), *module.packed.values()]:
                found[str(tensor.dtype).removeprefix("torch.")] += (tensor.numel()
                                                                   * tensor.element_size())
            for quantized in set(module.quantized.values()):
                found.update(quantized.bytes_by_format())
        return {name: size for name, size in found.items() if size}

    def _prepack(self, keep: tuple[torch.Tensor, ...] = ()) -> None:
        for name in self._LINEARS:
            if name in self.quantized:
                continue
            weight = getattr(self, name)
            self.packed[name] = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            if not any(weight is other for other in keep):
                weight.data = weight.data.new_empty(0)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``prepack`` applies: bf16 on a CPU whose oneDNN runs bf16."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
