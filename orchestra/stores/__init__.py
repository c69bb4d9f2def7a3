"""Stores: where a run's tasks live. `MemoryStore` is the default; durable stores come as extras."""

from ._memory import MemoryStore as MemoryStore

__all__ = ("MemoryStore",)
