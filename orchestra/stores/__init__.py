"""Stores: where a run's tasks live. `MemoryStore` is the default; `SQLiteStore` keeps runs in a
database file, so that a run resumes by its id after a crash. `Store` and `RunStore` are the
protocol a store implements."""

from ._memory import MemoryStore as MemoryStore
from ._protocol import RunStore as RunStore
from ._protocol import Store as Store
from ._sqlite._store import SQLiteStore as SQLiteStore

__all__ = ("MemoryStore", "RunStore", "SQLiteStore", "Store")

# Public names report this package as their module: reprs, docs and pickles say
# `orchestra.stores.MemoryStore`, not the private module it is defined in.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
