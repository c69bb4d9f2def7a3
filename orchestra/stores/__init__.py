"""Stores: where a run's tasks live. `MemoryStore` is the default; `SQLiteStore` keeps runs in a
database file, so that a run resumes by its id after a crash."""

from ._memory import MemoryStore as MemoryStore
from ._sqlite_store import SQLiteStore as SQLiteStore

__all__ = ("MemoryStore", "SQLiteStore")
