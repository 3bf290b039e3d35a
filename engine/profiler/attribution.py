"""Where the misses come from: every prompt token the configured cache recomputes is either

- **cold**: even an unlimited cache misses it: no earlier sequence in the namespace had this
  prefix (this also counts the last prompt token, which is always recomputed for its logits);
- **in flight** (only when requests overlap): an earlier request had this prefix but was
  still prefilling it when this one was admitted;
- **evicted**: an unlimited cache would have served it, so it was cached and then dropped.

Per request, with U the unlimited radix hit (serial), V the unlimited hit on the replay's own
timeline (V = U when requests do not overlap) and R the configured cache's hit::

    prompt = R + cold + in flight + evicted,
    cold = prompt - U,   in flight = U - V,   evicted = V - R

With a host tier, H of the evicted tokens were found there, and with a disk tier D more
(loaded, not recomputed): the ``host_hit`` and ``disk_hit`` parts of ``evicted``,
H + D <= V - R.

Block hashing loses what token matching finds past its last whole 16-token block, U - Bu with
Bu the unlimited block-hash hit (the extra hits of token matching with the capacity question
taken out), in two kinds:

- **shared head shorter than one block**: a request whose whole unlimited match is shorter
  than a block (0 < U < 16), reuse block hashing can never see: short head = U there, else 0;
- **block granularity**: the rest, the tokens of a longer match past its last whole block.

Block hashing at the configured capacity (B) also loses Bu - B to eviction. Per request::

    prompt = B + cold + short head + block granularity + block evicted
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from engine.profiler.baselines import BLOCK_SIZE
from engine.profiler.simulate import Profile


@dataclass
class Attribution:
    """Token totals over a trace (per-request arrays in ``per_request``)."""

    prompt_tokens: int
    hit: int
    cold: int
    in_flight: int
    evicted: int
    host_hit: int
    disk_hit: int
    block_hit: int
    short_head: int
    block_granularity: int
    block_evicted: int

    @property
    def missed(self) -> int:
        return self.cold + self.in_flight + self.evicted

    @property
    def block_missed(self) -> int:
        return self.cold + self.short_head + self.block_granularity + self.block_evicted

    def to_json(self) -> dict[str, int]:
        return {**asdict(self), "missed": self.missed, "block_missed": self.block_missed}


def per_request(profile: Profile) -> dict[str, np.ndarray]:
    """Per-request miss categories; raises if the caches contradict each other (a bug)."""
    prompt = profile.prompt_tokens
    radix, unlimited = profile.radix.cached, profile.unlimited.cached
    block, block_unlimited = profile.block.cached, profile.block_unlimited.cached
    short_head = np.where(unlimited < BLOCK_SIZE, unlimited, 0)
    visible = profile.radix.visible if profile.radix.visible is not None else unlimited
    host, disk = (tier if tier is not None else np.zeros_like(radix)
                  for tier in (profile.radix.host_cached, profile.radix.disk_cached))
    parts = {
        "cold": prompt - unlimited,
        "in_flight": unlimited - visible,
        "evicted": visible - radix,
        "host_hit": host,
        "disk_hit": disk,
        "evicted_beyond_tiers": visible - radix - host - disk,
        "short_head": short_head,
        "block_granularity": unlimited - block_unlimited - short_head,
        "block_evicted": block_unlimited - block,
    }
    for name, values in parts.items():
        bad = np.flatnonzero(values < 0)
        if bad.size:
            r = profile.requests[int(bad[0])]
            raise AssertionError(f"negative {name} tokens for request {r.id!r}: a cache hit "
                                 "more than its unlimited counterpart")
    return parts


def attribute(profile: Profile) -> Attribution:
    parts = per_request(profile)
    return Attribution(prompt_tokens=int(profile.prompt_tokens.sum()),
                       hit=int(profile.radix.cached.sum()),
                       block_hit=int(profile.block.cached.sum()),
                       **{f.name: int(parts[f.name].sum()) for f in fields(Attribution)
                          if f.name in parts})
