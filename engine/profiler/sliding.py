"""Sliding-window layers in the replay (``radixserve profile --sliding-kv-ratio R``): the tree
and both pools the engine's ``--sliding-kv-ratio`` makes, driven as its scheduler drives them.

A model whose ``K`` of ``L`` layers see the last ``W`` positions keeps, under ratio ``R``, a
full pool of ``N`` pages (the other layers' KV, as without it) and a sliding pool of
``int(R x N)`` pages for those ``K`` layers, sized as engine/worker/runner.py sizes them::

    bytes of a full page      P x per-layer bytes x (L - K)  +  ceil(R x P x per-layer bytes x K)
    full KV in the same bytes (N x (L - K) + sliding pages x K) // L  pages of every layer

The tree is radix/tree.py's with radix/sliding.py's pages, through a lease per request as the
scheduler's ``SeqMemory`` does it: prefill in chunks of ``--chunked-prefill-size`` tokens,
sliding the window before each (keeping the window where the prompt ends), the prompt
committed with its window kept, then decode page by page, sliding before each page, and the
release keeping the last window. So a match ends where the engine's would (a whole window of
kept sliding KV before it), and the sliding pool evicts kept windows before full pages as the
engine's does. Requests run one at a time (the serial replay): a prompt is committed when its
prefill ends, before any later request is admitted.

A host tier (``--host-cache-tokens`` / ``--host-cache-gb``) is the tree's own ``HostTier`` with
the engine's window pages beside its pages (``int(R x host pages)``, a host page paying for
its share as a device page does): nodes leaving the device take the windows they keep with
them, and a match reaches into the host tier where a window of kept sliding KV precedes its
end there too, the load giving the window back (radix/windows.py). Full KV in the same memory
gets a host tier in the same host memory. The disk tier is refused (``NO_DISK``): its window
files (scheduler/disk.py) are not modelled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.checkpoints.layer_windows import sliding_windows
from engine.profiler.kv_bytes import GIB, model_file
from engine.profiler.replay import CacheRun, CacheTooSmall, ServiceModel, Tiers, _Tree
from radix import Lease, OutOfPages
from radix.sliding import SlidingKV

if TYPE_CHECKING:
    from engine.profiler.kv_bytes import KVBytes


NO_DISK = ("--sliding-kv-ratio is replayed without a disk tier (the engine's window files, "
           "scheduler/disk.py, are not modelled): drop --disk-cache-tokens and --disk-cache-gb")


@dataclass(frozen=True)
class SlidingLayers:
    """Which of a model's layers see a window, and how wide it is."""

    num_sliding: int  # K
    num_layers: int  # L
    window: int  # W
    source: str

    @classmethod
    def of_windows(cls, windows: tuple[int | None, ...], source: str) -> SlidingLayers:
        """From each layer's window (None: the whole context); the engine's pool takes one
        window for every sliding layer."""
        sizes = sorted({w for w in windows if w is not None})
        if len(sizes) != 1:
            raise ValueError(f"--sliding-kv-ratio replays a model whose sliding layers share one "
                             f"window; {source} has " + (f"windows of {sizes}" if sizes else
                                                         "no sliding-window layer"))
        return cls(sum(w is not None for w in windows), len(windows), sizes[0], source)

    @classmethod
    def parse(cls, spec: str, window: int) -> SlidingLayers:
        """``--sliding-layers K/L`` and ``--sliding-window W``."""
        try:
            k, n = (int(part) for part in spec.split("/"))
        except ValueError:
            raise ValueError(f"--sliding-layers takes K/L (K of every L layers slide, such as "
                             f"5/6), not {spec!r}") from None
        if not 0 < k <= n:
            raise ValueError(f"--sliding-layers {spec}: K must be from 1 to L")
        if window < 2:
            raise ValueError(f"--sliding-window must be at least 2 positions, got {window}")
        return cls(k, n, window, f"--sliding-layers {spec} --sliding-window {window}")

    def describe(self) -> str:
        return (f"{self.num_sliding} of {self.num_layers} layers see the last {self.window:,} "
                f"positions ({self.source})")


def read_layers(path: str | Path) -> SlidingLayers:
    """The sliding layers of a checkpoint directory or .gguf file: its config.json (a GGUF's
    metadata as engine/checkpoints/gguf.py converts it into one), its layers' windows as the
    engine derives them (engine/checkpoints/layer_windows.py); no weights are read."""
    found = model_file(path)
    try:
        if found.suffix == ".gguf":
            from gguf import GGUFReader

            from engine.checkpoints.gguf import _Metadata
            from engine.checkpoints.gguf_architectures import check_architecture, hf_config

            meta = _Metadata(GGUFReader(found), found)
            check_architecture(meta.get("general.architecture"), found.name)
            raw, _ = hf_config(meta, meta.get("general.architecture"), tied=True, vocab_size=1)
        else:
            raw = json.loads(found.read_text(encoding="utf-8"))
        architecture = (raw.get("architectures") or [""])[0]
        windows = sliding_windows(raw, architecture, int(raw["num_hidden_layers"]))
    except (OSError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the layers of {found}: {exc!r}") from None
    return SlidingLayers.of_windows(windows, str(found))


@dataclass(frozen=True)
class SlidingPools:
    """The engine's two pools under ``--sliding-kv-ratio`` for a model's sliding layers."""

    layers: SlidingLayers
    ratio: float
    chunk: int  # --chunked-prefill-size

    def sliding_pages(self, num_pages: int) -> int:
        return int(self.ratio * num_pages)

    def least_sliding_pages(self, page_size: int) -> int:
        """What the engine refuses to start with less of: a prompt chunk and its window."""
        return -(-(self.chunk + self.layers.window) // page_size) + 2

    def full_kv_pages(self, num_pages: int) -> int:
        """Pages of every layer's KV that the two pools' memory holds."""
        k, n = self.layers.num_sliding, self.layers.num_layers
        return (num_pages * (n - k) + self.sliding_pages(num_pages) * k) // n

    def pages_in(self, kv: KVBytes, gib: float, page_size: int) -> int:
        """Full pages in ``gib`` GiB with their share of the sliding pool, as the engine's
        ``--kv-cache-gb``."""
        per_layer = kv.bytes_per_token * page_size // self.layers.num_layers
        k, n = self.layers.num_sliding, self.layers.num_layers
        return int(gib * GIB) // (per_layer * (n - k) + math.ceil(self.ratio * per_layer * k))

    def pool_bytes(self, kv: KVBytes, num_pages: int, page_size: int) -> dict[str, int]:
        """Bytes of the full pool, the sliding pool, and full KV in as many pages."""
        per_layer = kv.bytes_per_token * page_size // self.layers.num_layers
        k, n = self.layers.num_sliding, self.layers.num_layers
        return {"full_pool": num_pages * per_layer * (n - k),
                "sliding_pool": self.sliding_pages(num_pages) * per_layer * k,
                "full_kv": self.full_kv_pages(num_pages) * per_layer * n}

    def tree(self, num_pages: int, page_size: int, policy: str, tiers: Tiers,
             service: ServiceModel) -> SlidingTree:
        if tiers.disk_tokens:
            raise ValueError(NO_DISK)
        if service.overlaps:
            raise ValueError("--sliding-kv-ratio is replayed one request at a time: drop "
                             "--prefill-tps, --decode-tps and --durations")
        pages, least = self.sliding_pages(num_pages), self.least_sliding_pages(page_size)
        if pages < least:
            raise CacheTooSmall(
                f"--sliding-kv-ratio {self.ratio:g} gives the sliding layers {pages:,} pages, "
                f"fewer than one prompt chunk and its window need ({least:,}); give a larger "
                "ratio or cache, or a smaller --chunked-prefill-size")
        return SlidingTree(num_pages, page_size, policy, self, tiers)

    def full_kv_tiers(self, tiers: Tiers | None) -> Tiers | None:
        """The tiers of full KV in the same memory: a host tier of the pages of every layer
        that the host tier's full and window pages hold."""
        if tiers is None or not tiers.host_pages:
            return tiers
        return Tiers(self.full_kv_pages(tiers.host_pages), tiers.write_policy, tiers.disk_tokens)


class SlidingTree(_Tree):
    """The replay's tree with the sliding layers' pool (and a host tier's pages for windows:
    the host pool's share, as engine/worker/runner.py sizes it), each request holding what
    the engine's scheduler would hold (the module's docstring)."""

    def __init__(self, num_pages: int, page_size: int, policy: str, pools: SlidingPools,
                 tiers: Tiers) -> None:
        sliding = SlidingKV(pools.sliding_pages(num_pages), num_pages, page_size,
                            pools.layers.window)
        super().__init__(num_pages, page_size, policy, tiers.host_pages, tiers.write_policy,
                         sliding, pools.sliding_pages(tiers.host_pages))
        self.sliding, self.chunk, self.peak = sliding, pools.chunk, 0

    def admit(self, prompt: np.ndarray, namespace: str | None, num_tokens: int,
              max_len: int) -> tuple[Lease, list[int]]:
        lease = Lease(self.tree, prompt, namespace, max_len)
        prompt_len, page_size = len(prompt), self.alloc.page_size
        pages: list[int] = []
        try:
            computed = min(prompt_len, lease.length + self.chunk)
            pages, copy = lease.acquire(computed)
            if copy is not None:  # the copy has run (after the host tier's loads)
                self.alloc.decref([copy.src])
                self.sliding.decref([copy.src])
            self.moved()
            self._held()
            while computed < prompt_len:  # the next prefill chunk
                lease.slide(pages, computed, retain_end=prompt_len)
                computed = min(prompt_len, computed + self.chunk)
                lease.grow(pages, computed)
                self._held()
            lease.commit(pages, prompt, keep=True)
            # decode: of its steps only one that starts a page allocates
            for position in range(-(-prompt_len // page_size) * page_size, num_tokens,
                                  page_size):
                lease.slide(pages, position)
                lease.grow(pages, position + 1)
                self._held()
            lease.slide(pages, num_tokens - 1)
        except OutOfPages:
            if pages:
                lease.release(pages)
            else:
                lease.unlock()
            raise
        return lease, pages

    def _held(self) -> None:
        self.peak = max(self.peak, self.sliding.allocator.num_pinned_pages)

    def usage(self) -> dict[str, Any]:
        alloc, host = self.sliding.allocator, self.host
        return {"pages": alloc.num_pages, "peak_pages": self.peak,
                "evicted_window_pages": self.tree.stats.sliding_evicted_pages,
                **({"host_pages": host.num_pages,
                    "host_window_pages": host.swa.num_pages if host.swa is not None else 0,
                    "loaded_window_pages": self.tree.stats.sliding_loaded_pages}
                   if host is not None else {})}


def _host_hit_rate(run: CacheRun, prompt: np.ndarray) -> float | None:
    total = int(prompt.sum())
    if run.host_cached is None:
        return None
    return int(run.host_cached.sum()) / total if total else 0.0


def sliding_summary(pools: SlidingPools | None, radix: CacheRun, full_kv: CacheRun | None,
                    prompt: np.ndarray, num_pages: int, page_size: int,
                    kv: KVBytes | None) -> dict[str, Any] | None:
    """The sliding-window section of the report (None without ``--sliding-kv-ratio``): the
    replay with ``pools`` (``radix``, ``num_pages`` full pages, and its host tier's pages if
    it has one) and ``full_kv``'s in the same memory, on prompts of ``prompt`` tokens."""
    if pools is None or full_kv is None or radix.sliding is None:
        return None
    layers = pools.layers
    host_pages = radix.sliding.get("host_pages")
    size = None if kv is None else pools.pool_bytes(kv, num_pages, page_size)
    if size is not None and host_pages:
        size.update({f"host_{key}": value
                     for key, value in pools.pool_bytes(kv, host_pages, page_size).items()})
    return {"ratio": pools.ratio, "window": layers.window, "sliding_layers": layers.num_sliding,
            "layers": layers.num_layers, "source": layers.source,
            "chunked_prefill_size": pools.chunk,
            "full_pool_pages": num_pages,
            "sliding_pool_pages": radix.sliding["pages"],
            "sliding_peak_running_pages": radix.sliding["peak_pages"],
            "sliding_evicted_window_pages": radix.sliding["evicted_window_pages"],
            "hit_rate": radix.hit_rate(prompt),
            "full_kv_pages": full_kv.capacity_tokens // page_size,
            "full_kv_hit_rate": full_kv.hit_rate(prompt),
            # a host tier (None without): its full and window pages, the hits found there
            "host_pages": host_pages,
            "host_window_pages": radix.sliding.get("host_window_pages"),
            # windows the sliding pool evicted under device nodes, read back from the host tier
            "host_loaded_window_pages": radix.sliding.get("loaded_window_pages"),
            "host_hit_rate": _host_hit_rate(radix, prompt),
            "full_kv_host_pages": pools.full_kv_pages(host_pages) if host_pages else None,
            "full_kv_host_hit_rate": _host_hit_rate(full_kv, prompt),
            "bytes": size}


def pools_bytes(s: dict[str, Any] | None, tier: str = "") -> int | None:
    """The bytes of both pools in ``sliding_summary`` ``s`` (``tier`` "host_": of the host
    tier's); None where they are not known."""
    size = (s or {}).get("bytes") or {}
    if f"{tier}full_pool" not in size:
        return None
    return size[f"{tier}full_pool"] + size[f"{tier}sliding_pool"]


def sliding_lines(s: dict[str, Any]) -> list[str]:
    """The report's lines for ``sliding_summary``."""
    from engine.profiler.kv_bytes import format_bytes

    size = s["bytes"] or {}

    def pages(count: int, key: str) -> str:
        return f"{count:,} pages" + (f" ({format_bytes(size[key])})" if key in size else "")

    def pct(rate: float) -> str:
        return f"{100 * rate:.1f}%"

    lines = [f"sliding-window layers: {s['sliding_layers']} of {s['layers']} layers see the last "
             f"{s['window']:,} positions ({s['source']}); --sliding-kv-ratio {s['ratio']:g}",
             f"  full pool {pages(s['full_pool_pages'], 'full_pool')} + sliding pool "
             f"{pages(s['sliding_pool_pages'], 'sliding_pool')}: hit rate {pct(s['hit_rate'])}"
             f"; the running request held at most {s['sliding_peak_running_pages']:,} sliding "
             f"pages, {s['sliding_evicted_window_pages']:,} kept windows' pages were evicted",
             f"  full KV in the same memory: {pages(s['full_kv_pages'], 'full_kv')}: hit rate "
             f"{pct(s['full_kv_hit_rate'])}"]
    if s.get("host_pages"):
        lines.append(
            f"  host tier: full pool {pages(s['host_pages'], 'host_full_pool')} + sliding pool "
            f"{pages(s['host_window_pages'], 'host_sliding_pool')}: hit rate device "
            f"{pct(s['hit_rate'])} + host {pct(s['host_hit_rate'])} = "
            f"{pct(s['hit_rate'] + s['host_hit_rate'])} ({s['host_loaded_window_pages']:,} "
            f"windows' pages read back under device nodes); full KV in the same memory: "
            f"{pages(s['full_kv_host_pages'], 'host_full_kv')}: {pct(s['full_kv_hit_rate'])} + "
            f"{pct(s['full_kv_host_hit_rate'])} = "
            f"{pct(s['full_kv_hit_rate'] + s['full_kv_host_hit_rate'])}")
    return lines
