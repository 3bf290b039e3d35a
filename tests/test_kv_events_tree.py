"""KV cache events (scheduler/kv_events.py) against the radix tree they report on: under random
inserts, evictions and resets the blocks the events say are stored equal the blocks the tree
holds, per medium once a host tier moves them; salted paths hash apart; a tree is attached while
empty."""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import numpy as np
import pytest

from radix import OutOfPages
from scheduler.kv_events import BlockEvents
from tests.kv_gateway import Subscriber, reference_hash
from tests.radix_sim import Sim


@functools.cache
def block_hash(parent: int | None, namespace: str | None, block: tuple[int, ...]) -> int:
    """``reference_hash``, remembered: the walks from scratch below hash the same blocks again
    after every operation."""
    return reference_hash(parent, namespace, list(block))


def tree_blocks(tree, block_size: int) -> dict[int, tuple[str | None, list[int]]]:
    """Every whole block on every cached path, from scratch: hash → (namespace, prefix)."""
    blocks = {}
    for namespace, root in tree._roots.items():
        stack = [(root, [])]
        while stack:
            node, prefix = stack.pop()
            path = prefix + np.frombuffer(node.key, dtype=np.int32).tolist()
            parent = None
            for end in range(block_size, len(path) + 1, block_size):
                parent = block_hash(parent, namespace, tuple(path[end - block_size : end]))
                blocks[parent] = (namespace, path[:end])
            stack.extend((child, path) for child in node.children.values())
    return blocks


def random_operations(sim: Sim, rng: random.Random, namespaces: list[str | None],
                      resets: bool) -> Iterator[int]:
    """400 random operations on ``sim``, yielding each one's number once it is done: admit a
    path grown from one of six shared heads (55%, and whenever nothing runs), finish a running
    sequence (35%, caching it 9 times in 10), else evict and run the host tier's moves; with
    ``resets``, one operation in fifty finishes everything and resets the tree instead."""
    heads = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    for step in range(400):
        op = rng.random()
        if op < 0.55 or not sim.running:
            tokens = list(rng.choice(heads)) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            tokens = tokens[: rng.randrange(2, len(tokens) + 1)]
            try:
                sim.admit(tokens, rng.choice(namespaces))
            except OutOfPages:
                pass
        elif op < 0.9:
            sim.finish(rng.choice(sim.running), cache=rng.random() < 0.9)
        elif op < 0.98 or not resets:
            sim.tree.evict(rng.randrange(1, 12))
            sim.run_moves()
        else:
            for seq in list(sim.running):
                sim.finish(seq)
            sim.tree.reset()
        yield step


@pytest.mark.parametrize("page_size,block_size", [(1, 1), (1, 4), (4, 4), (4, 3), (16, 16),
                                                  (16, 5), (16, 32)])
def test_events_track_the_tree_exactly(page_size, block_size):
    rng = random.Random(page_size * 100 + block_size)
    sim = Sim(num_pages=max(8, 320 // page_size), page_size=page_size)
    events = BlockEvents(block_size)
    events.attach(sim.tree)
    gateway = Subscriber()
    for step in random_operations(sim, rng, [None, None, "tenant-a", "tenant-b"], resets=True):
        for event in events.take():
            gateway.apply(event)
        assert gateway.stored == set(tree_blocks(sim.tree, block_size)), f"step {step}"
        sim.check()


def tree_blocks_by_medium(tree, block_size: int) -> dict[str, set[int]]:
    """Every whole block by the tiers of the node that holds its last token, from scratch."""
    media: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for namespace, root in tree._roots.items():
        stack = [(root, [], None)]
        while stack:
            node, prefix, parent = stack.pop()
            path = prefix + np.frombuffer(node.key, dtype=np.int32).tolist()
            for end in range(block_size, len(path) + 1, block_size):
                if end <= len(prefix):
                    continue
                parent = block_hash(parent, namespace, tuple(path[end - block_size : end]))
                for medium, held in (("GPU", node.pages), ("CPU", node.host_pages)):
                    if held:
                        media[medium].add(parent)
            last = None
            for end in range(block_size, len(path) + 1, block_size):
                last = block_hash(last, namespace, tuple(path[end - block_size : end]))
            stack.extend((child, path, last) for child in node.children.values())
    return media


# Every policy at page 1 (each token a page: the most moves between tiers) and with blocks that
# straddle pages (16, 5); pages equal to blocks (4, 4) once: the policies change when host copies
# are made, not how a block is hashed, and each layout replays the same operations per policy.
@pytest.mark.parametrize("page_size,block_size,policy", [
    *[(1, 4, policy) for policy in ("write_back", "write_through", "write_through_selective")],
    *[(16, 5, policy) for policy in ("write_back", "write_through", "write_through_selective")],
    (4, 4, "write_back"),
])
def test_events_track_both_tiers(page_size, block_size, policy):
    """With a host tier, each medium's blocks ("GPU" for the device, "CPU" for host memory)
    follow the tree's nodes as they move between tiers, are loaded back and leave."""
    rng = random.Random(page_size * 7 + block_size)
    sim = Sim(num_pages=max(8, 160 // page_size), page_size=page_size,
              host_pages=max(8, 240 // page_size), policy=policy)
    events = BlockEvents(block_size)
    events.attach(sim.tree)
    media: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for step in random_operations(sim, rng, [None, "tenant-a"], resets=False):
        for event in events.take():
            name = type(event).__name__
            held = media[event.medium]
            if name == "BlockStored":
                assert not held & set(event.block_hashes), f"stored twice on {event.medium}"
                held.update(event.block_hashes)
            else:
                assert set(event.block_hashes) <= held, f"removed from {event.medium} unstored"
                held.difference_update(event.block_hashes)
        assert media == tree_blocks_by_medium(sim.tree, block_size), f"step {step}"
        sim.check()
    assert media["CPU"], "nothing reached the host tier"


def test_salted_paths_differ_and_name_their_salt():
    sim = Sim(num_pages=64, page_size=4)
    events = BlockEvents(4)
    events.attach(sim.tree)
    tokens = list(range(1, 14))
    for namespace in (None, "tenant-a"):
        sim.finish(sim.admit(tokens, namespace))
    plain, salted = events.take()
    assert plain.token_ids == salted.token_ids == tokens[:12]
    assert set(plain.block_hashes).isdisjoint(salted.block_hashes)
    assert plain.extra_keys is None and salted.extra_keys == [("tenant-a",), None, None]


def test_attach_refuses_a_tree_that_already_holds_blocks():
    sim = Sim(num_pages=16, page_size=4)
    sim.finish(sim.admit([1, 2, 3, 4, 5]))
    with pytest.raises(RuntimeError, match="empty tree"):
        BlockEvents(4).attach(sim.tree)
