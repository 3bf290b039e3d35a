"""Paged KV memory: refcounted pages and the radix tree over them. Imports no torch."""

from radix.pages import OutOfPages, PageAllocator, PageError
from radix.tree import CacheStats, Node, PrefixMatch, RadixTree

__all__ = ["CacheStats", "Node", "OutOfPages", "PageAllocator", "PageError", "PrefixMatch", "RadixTree"]
