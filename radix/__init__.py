"""Paged KV memory: refcounted pages and the radix tree over them. Imports no torch."""

from radix.host import WRITE_POLICIES, HostTier
from radix.lease import Lease, PageCopy
from radix.pages import OutOfPages, PageAllocator, PageError
from radix.tree import CacheStats, Node, PrefixMatch, RadixTree

__all__ = ["WRITE_POLICIES", "CacheStats", "HostTier", "Lease", "Node", "OutOfPages",
           "PageAllocator", "PageCopy", "PageError", "PrefixMatch", "RadixTree"]
