"""Attention over paged KV with FlashInfer's paged kernels (CUDA, fp16/bf16).

The page tables go to FlashInfer unchanged: ``kv_indptr`` = ``batch.page_indptr``,
``kv_indices`` = ``batch.page_indices``, ``kv_last_page_len`` = tokens in each sequence's last
page; the KV of a layer is the pool's ``(k_pages, v_pages)`` pair in NHD layout. A step whose
sequences all add one token runs ``BatchDecodeWithPagedKVCacheWrapper``; any other step (prefill,
chunked prefill, mixed prefill + decode) runs ``BatchPrefillWithPagedKVCacheWrapper`` with a
causal mask, which FlashInfer aligns to the end of each sequence (query j of an extend of n
sits at position seq_len - n + j), exactly the position convention of ``BatchInput``.

A wrapper is planned once per step and per distinct sliding window (FlashInfer fixes
``window_left`` at plan time), then run by every layer with that window.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from engine.attention.base import AttentionBackend
from engine.batch import BatchInput
from engine.kv_pool import KVPool

INSTALL_HINT = (
    "the flashinfer backend needs CUDA and the flashinfer-python package: "
    "pip install 'radixserve[gpu]'"
)
_WORKSPACE_BYTES = 128 * 1024 * 1024
# FlashInfer 0.6 builds its prefill kernels for these head sizes only.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def import_flashinfer() -> ModuleType:
    """Import flashinfer, or raise RuntimeError with the install hint."""
    if not torch.cuda.is_available():
        raise RuntimeError(INSTALL_HINT + " (CUDA is not available)")
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return flashinfer


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        pool: KVPool,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_windows: Sequence[int | None],
    ) -> None:
        super().__init__(
            pool,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_windows=sliding_windows,
        )
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"the flashinfer backend's kernels are built for head_dim "
                f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}; this model's is {head_dim}: use "
                "attention_backend='torch' (auto picks it by itself)"
            )
        flashinfer = import_flashinfer()
        if self.device.type != "cuda":
            raise RuntimeError(f"{INSTALL_HINT} (the KV pool is on {self.device}, not CUDA)")
        if pool.kv.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer backend runs float16 or bfloat16, not {pool.kv.dtype}; "
                "pass dtype='bfloat16' or attention_backend='torch'"
            )
        # Wrappers run one after another on one stream, so they can share the scratch space.
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # CUDA-core decode kernels cover small query groups only; tensor cores cover any.
        tensor_cores = num_heads // num_kv_heads >= 4
        windows = set(sliding_windows)
        self._decode = {
            w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores
            )
            for w in windows
        }
        self._prefill = {
            w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD") for w in windows
        }
        self._active: dict[int | None, object] = {}

    def _plan(self, batch: BatchInput) -> None:
        dtype, page_size = self.pool.kv.dtype, self.pool.page_size
        # Planning reads the small index arrays on the host; page ids go to the device once.
        kv_indptr = torch.from_numpy(batch.page_indptr.astype("int32"))
        kv_indices = torch.from_numpy(batch.page_indices.astype("int32")).to(self.device)
        last_page_len = torch.from_numpy(batch.last_page_lens(page_size))
        # sm_scale is left to FlashInfer's default, 1 / sqrt(head_dim), which is self.scale.
        common = dict(pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        if batch.is_decode:
            for window, wrapper in self._decode.items():
                wrapper.plan(
                    kv_indptr,
                    kv_indices,
                    last_page_len,
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    page_size,
                    window_left=_window_left(window),
                    **common,
                )
            self._active = dict(self._decode)
            return
        qo_indptr = torch.zeros(batch.num_seqs + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.from_numpy(batch.extend_lens.astype("int32")).cumsum(0)
        for window, wrapper in self._prefill.items():
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                page_size,
                causal=True,
                window_left=_window_left(window),
                **common,
            )
        self._active = dict(self._prefill)

    def warm_up(self) -> None:
        """Plan and run a prefill and a decode over the first pages, for every sliding window,
        before the server reports ready: FlashInfer 0.6 compiles each kernel on first use (so
        that is now, not inside the first request), and a broken install fails here. Only
        reads the pool (``_attend``, not ``forward``), which holds no one's KV yet."""
        page_size = self.pool.page_size
        pages = list(range(-(-2 // page_size)))  # room for two tokens
        first_layer = {w: self.sliding_windows.index(w) for w in set(self.sliding_windows)}
        for batch in (BatchInput.build([(pages, 0, [0, 0])], page_size, "all"),
                      BatchInput.build([(pages, 1, [0])], page_size)):
            self.plan(batch)
            q = torch.zeros(batch.num_tokens, self.num_heads, self.head_dim,
                            dtype=self.pool.kv.dtype, device=self.device)
            for layer in first_layer.values():
                self._attend(layer, q)
        torch.cuda.synchronize(self.device)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        wrapper = self._active[self.sliding_windows[layer]]
        return wrapper.run(q.contiguous(), self.pool.layer(layer))


def _window_left(window: int | None) -> int:
    # transformers lets a query see keys at distance < window; FlashInfer counts keys to the
    # left of the query (inclusive window of window_left + 1 tokens).
    return -1 if window is None else window - 1
