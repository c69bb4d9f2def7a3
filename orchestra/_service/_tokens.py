"""The service's bearer tokens, kept in the store's own database (``orchestra tokens``).

A token is 256 random bits from `secrets` (``orch_`` and 43 URL-safe characters), shown once when
it is made; the database keeps only its SHA-256. A plain hash is enough, and a password hash
(bcrypt, argon2) would only slow every request down: those are slow on purpose so that a guessable
password cannot be found from its hash, and 256 random bits are not guessable — nobody can search
that space, fast hash or slow. A token is found by its hash (an index lookup), and the hash found
is compared with `hmac.compare_digest` as well, so that no answer depends on how many characters
of a hash matched.

One table, ``tokens``, in the SQLite file (schema v5) or the PostgreSQL database (schema v4, in
the schema ``orchestra``): every replica on one database knows the same tokens, and a revoked
token is refused by all of them within `TOKEN_TTL` seconds (each trusts a token the database found
live that long: `Verified`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from .._exceptions import ConfigError, InputError
from ..stores import SQLiteStore

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable

    import asyncpg

__all__ = ("ROLES", "TOKEN_TTL", "Role", "TokenInfo", "Tokens", "Verified", "digest")

Role = Literal["submit", "read", "control", "worker", "admin"]
ROLES: Final[tuple[str, ...]] = get_args(Role)
"""What a token may do: submit runs, read them, control them (pause, resume, cancel, stop,
reprioritize, retry), work for them (HTTP workers), or all of it (admin)."""

# What a role may do beyond its own name: a controller sees what it steers (the dashboard's
# buttons, a script that pauses a run and reads its status); admin does everything.
_GRANTS: Final[dict[str, tuple[str, ...]]] = {"control": ("control", "read"), "admin": ROLES}

_PREFIX: Final = "orch_"  # what tells an orchestra token apart in a file or a log

TOKEN_TTL: Final = 5.0
"""Seconds a service process trusts a token the database found live without asking again: a
revoked token is refused by every process within this long."""


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A token as the database knows it (never its text)."""

    id: str
    name: str | None
    role: str
    created: float
    revoked: float | None

    def allows(self, role: str) -> bool:
        return self.revoked is None and role in _GRANTS.get(self.role, (self.role,))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "role": self.role,
            "created": self.created,
            "revoked": self.revoked,
        }


def digest(token: str) -> str:
    """The SHA-256 of `token`, as the database keeps it."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _info(row: Any) -> TokenInfo:
    return TokenInfo(row[0], row[1], row[2], float(row[3]), None if row[4] is None else row[4])


# -- SQLite: jobs of the store's writer thread -----------------------------------------------------

_COLUMNS: Final = "id, name, role, created, revoked"


def _sqlite_add(conn: sqlite3.Connection, info: TokenInfo, hashed: str) -> None:
    conn.execute(
        "INSERT INTO tokens (id, name, role, hash, created) VALUES (?, ?, ?, ?, ?)",
        (info.id, info.name, info.role, hashed, info.created),
    )


def _sqlite_list(conn: sqlite3.Connection) -> list[TokenInfo]:
    return [_info(r) for r in conn.execute(f"SELECT {_COLUMNS} FROM tokens ORDER BY created")]


def _sqlite_revoke(conn: sqlite3.Connection, which: str, now: float) -> list[TokenInfo]:
    conn.execute(
        "UPDATE tokens SET revoked = ? WHERE (id = ? OR name = ?) AND revoked IS NULL",
        (now, which, which),
    )
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM tokens WHERE id = ? OR name = ? ORDER BY created", (which, which)
    )
    return [_info(r) for r in rows]


def _sqlite_find(conn: sqlite3.Connection, hashed: str) -> tuple[TokenInfo, str] | None:
    row = conn.execute(f"SELECT {_COLUMNS}, hash FROM tokens WHERE hash = ?", (hashed,)).fetchone()
    return None if row is None else (_info(row), row[5])


# -- PostgreSQL: jobs of the store's database thread -----------------------------------------------

_PG_COLUMNS: Final = (
    "id, name, role, extract(epoch FROM created)::float8, extract(epoch FROM revoked)::float8"
)


async def _pg_add(conn: asyncpg.Connection, info: TokenInfo, hashed: str) -> float:
    created: float = await conn.fetchval(
        "INSERT INTO orchestra.tokens (id, name, role, hash) VALUES ($1, $2, $3, $4) "
        "RETURNING extract(epoch FROM created)::float8",
        info.id,
        info.name,
        info.role,
        hashed,
    )
    return created


async def _pg_list(conn: asyncpg.Connection) -> list[TokenInfo]:
    rows = await conn.fetch(f"SELECT {_PG_COLUMNS} FROM orchestra.tokens ORDER BY created")
    return [_info(r) for r in rows]


async def _pg_revoke(conn: asyncpg.Connection, which: str) -> list[TokenInfo]:
    await conn.execute(
        "UPDATE orchestra.tokens SET revoked = now() WHERE (id = $1 OR name = $1) "
        "AND revoked IS NULL",
        which,
    )
    rows = await conn.fetch(
        f"SELECT {_PG_COLUMNS} FROM orchestra.tokens WHERE id = $1 OR name = $1 ORDER BY created",
        which,
    )
    return [_info(r) for r in rows]


async def _pg_find(conn: asyncpg.Connection, hashed: str) -> tuple[TokenInfo, str] | None:
    row = await conn.fetchrow(
        f"SELECT {_PG_COLUMNS}, hash FROM orchestra.tokens WHERE hash = $1", hashed
    )
    return None if row is None else (_info(row), row[5])


class Tokens:
    """The tokens of a store's database (a `SQLiteStore` or a `PostgresStore`)."""

    def __init__(self, store: Any) -> None:
        self._sqlite = isinstance(store, SQLiteStore)
        if not self._sqlite and not hasattr(store, "database"):
            raise InputError(
                f"tokens are kept in a SQLiteStore's file or a PostgresStore's database, not in "
                f"{type(store).__name__}",
                field="store",
            )
        self.store = store

    def create(self, role: str, name: str | None = None) -> tuple[str, TokenInfo]:
        """A new token of `role`: its text (shown once: only its hash is kept) and its record."""
        if role not in ROLES:
            raise InputError(f"unknown role {role!r}: give one of {', '.join(ROLES)}", field="role")
        token = _PREFIX + secrets.token_urlsafe(32)  # 32 bytes: 256 random bits
        info = TokenInfo(secrets.token_hex(4), name, role, time.time(), None)
        if self._sqlite:
            self.store.call(_sqlite_add, info, digest(token))
        else:
            created = self.store.database.call(_pg_add, info, digest(token))
            info = TokenInfo(info.id, name, role, created, None)
        return token, info

    def listed(self) -> list[TokenInfo]:
        """Every token, oldest first, revoked ones too."""
        if self._sqlite:
            return self.store.call(_sqlite_list)  # type: ignore[no-any-return]
        return self.store.database.call(_pg_list)  # type: ignore[no-any-return]

    def revoke(self, which: str) -> list[TokenInfo]:
        """Revoke the tokens whose id or name is `which`; the tokens it names (empty: none)."""
        if self._sqlite:
            return self.store.call(_sqlite_revoke, which, time.time())  # type: ignore[no-any-return]
        return self.store.database.call(_pg_revoke, which)  # type: ignore[no-any-return]

    def ensure(self, token: str, role: str, name: str) -> TokenInfo:
        """Keep `token` (a text chosen elsewhere, ``orchestra serve --workers-token``) with
        `role`, unless the database knows it already; its record."""
        # Read from a file (a mounted secret), it comes with a newline; an HTTP header's value
        # reaches the service without its surrounding whitespace, so keep it without too.
        token = token.strip()
        if len(token) < 32:
            raise InputError(
                "a token given by hand must be at least 32 characters long (make one with "
                "`orchestra tokens create --role ROLE`, or `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`)",
                field="token",
            )
        if role not in ROLES:
            raise InputError(f"unknown role {role!r}: give one of {', '.join(ROLES)}", field="role")
        hashed = digest(token)
        if self._sqlite:
            found = self.store.call(_sqlite_find, hashed)
        else:
            found = self.store.database.call(_pg_find, hashed)
        if found is not None:
            return found[0]  # type: ignore[no-any-return]
        info = TokenInfo(secrets.token_hex(4), name, role, time.time(), None)
        if self._sqlite:
            self.store.call(_sqlite_add, info, hashed)
        else:
            self.store.database.call(_pg_add, info, hashed)
        return info

    async def find(self, token: str) -> TokenInfo | None:
        """The record of `token` (revoked or not), or None when the database has no such token."""
        hashed = digest(token)
        if self._sqlite:
            found = await asyncio.wrap_future(self.store.submit(_sqlite_find, hashed))
        else:
            found = await self.store.database.run(_pg_find, hashed)
        if found is None:
            return None
        info, kept = found
        return info if hmac.compare_digest(kept, hashed) else None


class Verified:
    """The tokens the database found live in the last `ttl` seconds, by their hash: a request
    with one of them goes through without a database read (an HTTP worker sends a request for each
    claim, heartbeat and completion). A token revoked meanwhile is refused once its entry expired,
    so `ttl` bounds how long a revoked token still works. A token the database does not know, or
    knows revoked, is never kept: it is asked about at each request.

    Written by hand, not with cachetools' `TTLCache` (one more dependency, untyped): every entry
    lives the same `ttl`, so the map's insertion order is its expiry order, and an `OrderedDict`
    drops the expired entries from its front and the oldest past `size`, in a few lines.

    Args:
        tokens: the database's tokens, asked when a token is not kept here.
        ttl: seconds an entry is trusted (0: never kept, every request reads the database).
        size: the most tokens kept at once (the oldest goes first).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        tokens: Tokens,
        *,
        ttl: float = TOKEN_TTL,
        size: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 <= ttl < 3600:
            raise ConfigError(
                f"token_ttl must be seconds from 0 (no cache) to under an hour, got {ttl!r}"
            )
        self.tokens = tokens
        self.ttl = float(ttl)
        self._size = size
        self._clock = clock
        # A token's hash -> when its entry expires (clock time), its record. Looked up by the hash,
        # as the database is: what a lookup's time could tell of a hash is no step to a token.
        self._kept: OrderedDict[str, tuple[float, TokenInfo]] = OrderedDict()

    async def find(self, token: str) -> TokenInfo | None:
        """The record of `token` (as `Tokens.find`), from the map while its entry is fresh."""
        hashed = digest(token)
        # The clock read before the database is: an entry expires `ttl` after a read that began
        # before it, so it never outlives a revocation committed after that read by more than it.
        now = self._clock()
        kept = self._kept
        while kept:
            expires, _ = kept[next(iter(kept))]
            if expires > now:
                break
            kept.popitem(last=False)
        found = kept.get(hashed)
        if found is not None and found[0] > now:
            return found[1]
        info = await self.tokens.find(token)
        if info is not None and info.revoked is None and self.ttl > 0:
            kept[hashed] = (now + self.ttl, info)
            kept.move_to_end(hashed)
            if len(kept) > self._size:
                kept.popitem(last=False)
        return info
