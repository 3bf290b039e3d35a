"""What a gateway that reads our KV events computes, written here from the documented
definitions (docs/scale-out.md) rather than from scheduler/kv_events.py: a block's hash, and the
set of stored blocks kept from the events alone."""

from __future__ import annotations

from hashlib import blake2b


def reference_hash(parent: int | None, namespace: str | None, tokens: list[int]) -> int:
    if parent is None:
        head = b"radixserve-kv\x00" if namespace is None else b"radixserve-kv\x01" + namespace.encode()
        parent = int.from_bytes(blake2b(head, digest_size=8).digest(), "little")
    data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little", signed=True)
                                                   for t in tokens)
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little")


class Subscriber:
    """What a gateway keeps: the set of stored block hashes, from the events alone."""

    def __init__(self) -> None:
        self.stored: set[int] = set()

    def apply(self, event) -> None:
        name = type(event).__name__
        if name.endswith("BlockStored"):
            assert event.parent_block_hash is None or event.parent_block_hash in self.stored, (
                "a block stored under a parent the gateway does not hold")
            size = event.block_size
            parent = event.parent_block_hash
            salt = event.extra_keys[0][0] if event.extra_keys and event.extra_keys[0] else None
            for i, block_hash in enumerate(event.block_hashes):
                assert block_hash not in self.stored, "a block stored twice"
                if parent is None:  # a path's first block: its hash starts from the namespace
                    assert block_hash == reference_hash(None, salt, event.token_ids[:size])
                else:
                    assert block_hash == reference_hash(
                        parent, None, event.token_ids[i * size : (i + 1) * size])
                self.stored.add(block_hash)
                parent = block_hash
        elif name.endswith("BlockRemoved"):
            for block_hash in event.block_hashes:
                assert block_hash in self.stored, "a block removed that was never stored"
                self.stored.remove(block_hash)
        else:
            self.stored.clear()
