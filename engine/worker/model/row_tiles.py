"""Dense products whose rows do not depend on the call (``--deterministic``).

oneDNN and MKL pick their kernels, and with them the order in which a row's sums run, by the
number of rows in the call: in fp32 a row alone differs from the same row beside others, in bf16
calls of 33 rows and more differ from those of 32. Within calls of one shape a row's result does
not depend on its place or on the thread count (tests/test_deterministic.py), so a product run
in calls of exactly ``DENSE_ROW_TILE`` rows gives every row the same bits whatever the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows of each dense product call: a decode step of up to 16 sequences takes one call.
DENSE_ROW_TILE = 16


def in_row_tiles(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 tile: int = DENSE_ROW_TILE) -> torch.Tensor:
    """``product`` of ``x`` [rows, ...] in calls of exactly ``tile`` rows, the last padded with
    zeros."""
    rows = x.shape[0]
    padded = x.new_zeros(-(-rows // tile) * tile, *x.shape[1:])
    padded[:rows] = x
    return torch.cat([product(part) for part in padded.split(tile)])[:rows]
