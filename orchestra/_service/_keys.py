"""Idempotency keys: the run each ``Idempotency-Key`` started, and the request that started it.

A key names one request: sent again with the same request it answers the same run; sent with
another (other tasks, another input), it is refused, since answering the first run would tell
the client its new request was taken. Kept in the store's database (`service_keys`, beside the
tokens), so every process serving it, and the same process after a restart, answers the same.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

from ..stores import SQLiteStore

if TYPE_CHECKING:
    import sqlite3

    import asyncpg

__all__ = ("Keys", "request_digest")


def request_digest(request: dict[str, Any]) -> str:
    """The SHA-256 of a submission as JSON with its keys sorted: the same request, whatever the
    order its objects' fields were sent in, has the same digest."""
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _sqlite_find(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT digest FROM service_keys WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _sqlite_keep(conn: sqlite3.Connection, key: str, run_id: str, digest: str, now: float) -> None:
    conn.execute(
        "INSERT OR IGNORE INTO service_keys (key, run_id, digest, created) VALUES (?, ?, ?, ?)",
        (key, run_id, digest, now),
    )


async def _pg_find(conn: asyncpg.Connection, key: str) -> str | None:
    found: str | None = await conn.fetchval(
        "SELECT digest FROM orchestra.service_keys WHERE key = $1", key
    )
    return found


async def _pg_keep(conn: asyncpg.Connection, key: str, run_id: str, digest: str) -> None:
    await conn.execute(
        "INSERT INTO orchestra.service_keys (key, run_id, digest) VALUES ($1, $2, $3) "
        "ON CONFLICT (key) DO NOTHING",
        key, run_id, digest,
    )  # fmt: skip


class Keys:
    """The idempotency keys of a store's database (a `SQLiteStore` or a `PostgresStore`); its
    calls block (the service makes them in a worker thread)."""

    def __init__(self, store: Any) -> None:
        self._sqlite = isinstance(store, SQLiteStore)
        self.store = store

    def digest_of(self, key: str) -> str | None:
        """The digest of the request `key` started a run with, or None when it started none."""
        if self._sqlite:
            return self.store.call(_sqlite_find, key)  # type: ignore[no-any-return]
        return self.store.database.call(_pg_find, key)  # type: ignore[no-any-return]

    def keep(self, key: str, run_id: str, digest: str) -> None:
        """Write down that `key` started `run_id` with the request of `digest` (the first
        request's stays when two raced)."""
        if self._sqlite:
            self.store.call(_sqlite_keep, key, run_id, digest, time.time())
        else:
            self.store.database.call(_pg_keep, key, run_id, digest)
