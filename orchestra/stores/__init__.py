"""Stores: where a run's tasks live. `MemoryStore` is the default; `SQLiteStore` keeps runs in a
database file, so that a run resumes by its id after a crash; `PostgresStore` keeps them in a
PostgreSQL database that worker processes on many machines share (the ``postgres`` extra). `Store`
and `RunStore` are the protocol a store implements."""

from typing import TYPE_CHECKING, Any

from ._memory import MemoryStore as MemoryStore
from ._protocol import RunStore as RunStore
from ._protocol import Store as Store
from ._sqlite._store import SQLiteStore as SQLiteStore

if TYPE_CHECKING:
    from ._postgres._store import PostgresStore as PostgresStore

__all__ = ("MemoryStore", "PostgresStore", "RunStore", "SQLiteStore", "Store")

# Public names report this package as their module: reprs, docs and pickles say
# `orchestra.stores.MemoryStore`, not the private module it is defined in.
for _name in ("MemoryStore", "RunStore", "SQLiteStore", "Store"):
    globals()[_name].__module__ = __name__
del _name


def __getattr__(name: str) -> Any:
    # PEP 562: asyncpg (the `postgres` extra) is loaded only by who uses PostgreSQL.
    if name == "PostgresStore":
        try:
            from ._postgres._store import PostgresStore
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"PostgresStore needs {exc.name or 'asyncpg'}: "
                "pip install 'orchestra-runtime[postgres]'",
                name=exc.name,
            ) from exc
        PostgresStore.__module__ = __name__
        globals()[name] = PostgresStore
        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
