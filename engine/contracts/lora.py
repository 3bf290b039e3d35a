"""LoRA adapters as every process sees them: a name, a small integer id, a rank and a hash of
the adapter's files.

The model worker loads the adapters (engine/worker/model/lora.py) and reports each one as a
``LoraAdapterInfo``; the scheduler maps a request's adapter name to its id, which every step
message carries per sequence (``BatchInput.lora_ids``; 0 is the base model), and to its cache
namespace: KV computed under an adapter that touches k or v differs from the base model's, so
each adapter's prefixes are cached apart (``lora_namespace``). The namespace holds the content
hash, so the disk tier's hash chain and the KV events change when an adapter's weights do.
"""

from __future__ import annotations

import msgspec

BASE_MODEL = 0  # the lora id of a sequence without an adapter


class LoraAdapterInfo(msgspec.Struct, array_like=True):
    """One loaded adapter: ``lora_id`` >= 1, its rank and the sha256 (hex, 16 digits) of its
    config and weights files."""

    name: str
    lora_id: int
    rank: int
    content_hash: str
    path: str = ""


def parse_lora_modules(modules: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules NAME=PATH ...`` as (name, path) pairs; ValueError with a sentence for a
    malformed or repeated entry."""
    pairs: list[tuple[str, str]] = []
    for module in modules or []:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH entries, got {module!r}")
        if any(name == seen for seen, _ in pairs):
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        pairs.append((name, path))
    return pairs


def lora_namespace(namespace: str | None, adapter: LoraAdapterInfo | None) -> str | None:
    """The cache namespace of a request in ``namespace`` (its tenant's, or None) under
    ``adapter`` (None: the base model, whose namespace is unchanged)."""
    if adapter is None:
        return namespace
    own = f"lora:{adapter.name}:{adapter.content_hash}"
    return own if namespace is None else f"{namespace}|{own}"
