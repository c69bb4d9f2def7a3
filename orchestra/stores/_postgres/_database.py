"""The PostgreSQL store's connections, and the one thread whose event loop uses them.

A `RunStore` is called synchronously on the run's event loop (the protocol: `claim` hands out a
task now, `settle` returns whether it was written), and the store's contract suite drives a run
with no loop at all. So the store's I/O lives where the SQLite store's does, in a thread of its
own: here one that runs an asyncio loop holding the asyncpg pool, the listening connection and
their background loops. A job is a coroutine function of a connection first (the functions of
`_leases`, `_graph`, `_settle`, `_coordinator`); `submit` runs it on a pooled connection in that
thread and answers with a `concurrent.futures.Future`, which the run's loop awaits
(`asyncio.wrap_future`) or a synchronous caller waits for. Written by hand rather than with a
library: what is needed is a loop in a thread that lives as long as the store (anyio's
``start_blocking_portal`` is that, but it must be left from the thread that entered it, and a store
closed by the garbage collector is left from wherever that runs).

Errors of the database's connection (it cannot be reached, the password is wrong, it went away)
reach the caller as a `StoreError` that says what to do (`explain`); errors of orchestra's own
SQL are not caught here.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Final, cast
from urllib.parse import urlsplit

import asyncpg

from ..._exceptions import StoreError
from ._leases import SERVER_SETTINGS
from ._schema import migrate
from ._sessions import application_name

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from asyncpg.pool import PoolConnectionProxy

__all__ = ("Database", "Local", "explain", "where")

_CONNECT_TIMEOUT: Final = 10.0  # seconds a new connection may take before the store gives up
_BACKOFF: Final = 0.05  # the first wait before a job runs again on a new connection
_MAX_BACKOFF: Final = 2.0

# What says the connection was lost, not that the job was wrong.
_LOST: Final = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,  # the server is starting up or shutting down
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.InternalClientError,  # "not connected", a protocol cut off mid-statement
    asyncpg.QueryCanceledError,  # past `statement_timeout`: this process was paused mid-way
)


class Database:
    """The pool of connections to one PostgreSQL database, used from a thread of its own.

    Args:
        dsn: the database's connection string (``postgresql://user:password@host:port/db``).
        max_connections: the pool's size: the connections jobs run on at once (the listener's
            connection is one more).
        reconnect_for: seconds a job whose connection was lost keeps trying on new ones (a
            database restarting) before it fails with `StoreError`.
    """

    def __init__(
        self,
        dsn: str,
        *,
        max_connections: int = 4,
        reconnect_for: float = 30.0,
        idle_in_transaction: float | None = None,
        statement_timeout: float | None = None,
    ) -> None:
        self.dsn = dsn
        # A process paused inside a transaction (SIGSTOP, a frozen VM) would keep its row locks,
        # and every process that needs those rows would wait on it: the server ends its session
        # once it sat idle inside a transaction this long (shorter than a lease, so that what
        # waits for its lease to lapse is not held up by its locks as well).
        self.settings = dict(SERVER_SETTINGS)
        # Whose sessions these are, for a process that finds this one stalled (`_sessions`).
        self.settings["application_name"] = application_name()
        if idle_in_transaction is not None:
            self.settings["idle_in_transaction_session_timeout"] = (
                f"{max(1, int(idle_in_transaction * 1000))}ms"
            )
        if statement_timeout is not None:
            # The same for one paused between the messages of one statement (the server then
            # waits for it, "active", not idle): the statement is cancelled, its locks let go.
            self.settings["statement_timeout"] = f"{max(1, int(statement_timeout * 1000))}ms"
        self.max_connections = max_connections
        self.reconnect_for = reconnect_for
        self.closed = False
        self._pool: asyncpg.Pool | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._opening: asyncio.Lock | None = None  # (the thread's loop's) one opens the pool

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Future[Any]:
        """Run ``await job(conn, *args)`` on a pooled connection, in the store's thread."""
        return self.spawn(self.within, job, *args)

    def spawn(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Future[Any]:
        """Run ``await job(*args)`` in the store's thread (a job that takes connections itself,
        from `pool`, or runs until cancelled: a listener). Cancel the future to cancel it."""
        if self.closed:
            future: Future[Any] = Future()
            future.set_exception(
                StoreError(
                    f"{where(self.dsn)}: its PostgresStore was closed (store.close()): open a new "
                    "PostgresStore on it to use it again"
                )
            )
            return future
        loop = self._start()
        return asyncio.run_coroutine_threadsafe(job(*args), loop)

    def call(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """`submit` and wait for the answer (from a thread that is not the store's)."""
        return self.submit(job, *args).result()

    async def run(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """`submit`, awaited from another event loop (a run's, a worker's)."""
        return await asyncio.wrap_future(self.submit(job, *args))

    async def pool(self) -> asyncpg.Pool:
        """The pool (in the store's thread), opened and the schema migrated on first use."""
        if self._pool is not None:
            return self._pool
        assert self._opening is not None
        async with self._opening:
            opened = self._opened()  # (again: another job may have opened it while this waited)
            if opened is not None:
                return opened
            pool = await self._create_pool()
            try:
                async with pool.acquire() as conn:
                    await migrate(cast("asyncpg.Connection", conn))
            except BaseException:
                await pool.close()
                raise
            self._pool = pool
            return pool

    def _opened(self) -> asyncpg.Pool | None:
        return self._pool

    async def _create_pool(self) -> asyncpg.Pool:
        """A new pool of this database's connections, on the running loop."""
        try:
            return await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=self.max_connections,
                server_settings=self.settings,
                timeout=_CONNECT_TIMEOUT,
                reset=_keep_session,
            )
        except (
            TimeoutError, OSError, ValueError, asyncpg.PostgresError,
            asyncpg.ClientConfigurationError,
        ) as exc:  # fmt: skip
            raise StoreError(explain(exc, self.dsn)) from exc

    async def within(
        self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **options: Any
    ) -> Any:
        """``await job(conn, *args)`` on a pooled connection, from the store's thread itself (a
        background loop's job), run again on a new connection when the one it had was lost."""
        return await self._retried(await self.pool(), job, *args, **options)

    async def local(self) -> Local:
        """A pool of this database's connections on the running event loop (not the store's
        thread), until its `Local.close`: its jobs (`Local.run`) hop to no other thread. A
        worker's claims and completions go so: an answer handed from the store's thread to the
        worker's loop cost, per job, a wake-up of that loop and a wait for the interpreter's lock
        against the thread. The schema is the store's to migrate (`pool`): open that first."""
        return Local(self, await self._create_pool())

    async def _retried(
        self,
        pool: asyncpg.Pool,
        job: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
        **options: Any,
    ) -> Any:
        """``await job(conn, *args)`` on a connection of `pool`, on the loop `pool` belongs to."""
        # A connection lost once the database was reached (a restart, a failover, a network
        # cut): the job runs again on a new one, after a capped backoff, for `reconnect_for`
        # seconds. A job is one transaction, rolled back when its connection was lost; one
        # whose commit got through but whose answer did not is refused or a no-op when run
        # again (fenced by its lease's token, or the same admission), at worst a failed
        # attempt's row twice.
        deadline = time.monotonic() + self.reconnect_for
        backoff = _BACKOFF
        while True:
            try:
                async with pool.acquire() as conn:
                    try:
                        # (a pooled connection proxies a `Connection`: the jobs are typed so)
                        return await job(cast("asyncpg.Connection", conn), *args, **options)
                    except asyncpg.InternalClientError:
                        # Its protocol broke with the connection (mid-statement): never reused.
                        conn.terminate()
                        raise
            except _LOST as exc:
                if isinstance(exc, asyncpg.InterfaceError) and "closed" not in str(exc):
                    raise
                if time.monotonic() + backoff > deadline:
                    raise StoreError(explain(exc, self.dsn)) from exc
                await asyncio.sleep(backoff * (0.5 + random.random() / 2))
                backoff = min(backoff * 2, _MAX_BACKOFF)

    # -- the thread ------------------------------------------------------------------------------

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    self._opening = asyncio.Lock()
                    started.set()
                    try:
                        loop.run_forever()
                    finally:
                        loop.run_until_complete(loop.shutdown_asyncgens())
                        loop.close()

                self._thread = threading.Thread(
                    target=serve, name=f"orchestra-postgres:{where(self.dsn)}", daemon=True
                )
                self._thread.start()
                started.wait()
                self._loop = loop
            return self._loop

    def close(self, timeout: float = 10.0) -> None:
        """Close the pool and stop the thread (after the jobs already running). Safe to call
        twice, and from a `weakref.finalize`."""
        with self._lock:
            self.closed = True
            loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return

        async def shut() -> None:
            pool, self._pool = self._pool, None
            if pool is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pool.close(), timeout)
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), loop).result(timeout + 1)
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(loop.stop)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class Local:
    """A `Database`'s pool on one event loop (`Database.local`), one of whose connections is kept
    out of it between jobs: a job that finds that one free runs on it, with none of the pool's
    acquire and release (asyncpg's release runs as a shielded task of its own: a turn of the
    loop or two and its bookkeeping, about as much client CPU as two round trips, once per job).
    A worker's group commits are one job each, one at a time; a job that finds the kept
    connection taken (a claim or a heartbeat meanwhile) goes to the pool."""

    __slots__ = ("_busy", "_closing", "_kept", "database", "pool")

    def __init__(self, database: Database, pool: asyncpg.Pool) -> None:
        self.database = database
        self.pool = pool
        self._kept: PoolConnectionProxy | None = None
        self._busy = False  # a job runs on the kept connection
        self._closing = False

    async def run(self, job: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """``await job(conn, *args)`` on a connection of this pool, reconnected and explained as
        `Database.within`'s."""
        if self._busy or self._closing:
            return await self.database._retried(self.pool, job, *args)
        self._busy = True
        try:
            conn = self._kept
            if conn is not None and not _alive(conn):
                conn = self._kept = None  # its session ended while no job ran on it
            if conn is None:
                try:
                    conn = await self.pool.acquire()
                except _LOST:  # the pool's way: waits, reconnects, or explains
                    return await self.database._retried(self.pool, job, *args)
                self._kept = conn
            try:
                # (a pooled connection proxies a `Connection`: the jobs are typed so)
                return await job(cast("asyncpg.Connection", conn), *args)
            except BaseException as exc:
                # What it left is not known (a statement cut, a transaction open): back to the
                # pool, which resets the connection or drops it; a job whose connection was lost
                # runs again as the pool's jobs do.
                self._kept = None
                lost = isinstance(exc, _LOST) and (
                    not isinstance(exc, asyncpg.InterfaceError)
                    or "closed" in str(exc)
                    or not _alive(conn)  # (the pool took it back as its session ended)
                )
                if isinstance(exc, asyncpg.InternalClientError):
                    conn.terminate()  # its protocol broke mid-statement: never reused
                await self.pool.release(conn)  # (a no-op for one the pool took back)
                if lost:
                    return await self.database._retried(self.pool, job, *args)
                raise
        finally:
            self._busy = False
            await self._let_go()  # (`close` came while the job ran: the pool waits for it)

    async def _let_go(self) -> None:
        """Back to the pool with the kept connection, once closing."""
        if self._closing and self._kept is not None:
            kept, self._kept = self._kept, None
            await self.pool.release(kept)

    async def close(self) -> None:
        """Close its connections once their jobs are over (cut after `_CONNECT_TIMEOUT`)."""
        self._closing = True
        try:
            if not self._busy:  # (a busy one is let go by its job)
                await self._let_go()
            await asyncio.wait_for(self.pool.close(), _CONNECT_TIMEOUT)
        except Exception:  # a server gone, a job that would not end: nothing left to wait for
            self.pool.terminate()


def _alive(conn: PoolConnectionProxy) -> bool:
    """Whether a connection kept out of the pool can still run a job: the pool takes back a
    connection whose session ended, and one taken back refuses every call."""
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a connection back in the pool needs reset: nothing past what asyncpg always does (an
    open transaction rolled back, its listeners dropped). asyncpg's default reset is one more
    round trip per job (``pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL``) undoing
    what the jobs never leave behind: their advisory locks are a transaction's, they LISTEN on a
    connection of their own (`_listen.Listener`), declare no cursor and SET nothing for the
    session (its settings are the pool's, `server_settings`)."""


def where(dsn: str) -> str:
    """The database a DSN names, for messages: ``PostgreSQL at host:port/db`` (never its
    password)."""
    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        port = parts.port or 5432
        database = parts.path.lstrip("/") or parts.username or "postgres"
    except ValueError:
        return "PostgreSQL (an unreadable DSN)"
    return f"PostgreSQL at {host}:{port}/{database}"


def explain(exc: BaseException, dsn: str) -> str:
    """What is wrong with the database, in words, and what to do."""
    at = where(dsn)
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        hint = "it refused the user or password: check the DSN's credentials"
    elif isinstance(exc, asyncpg.InvalidCatalogNameError):
        hint = "the database does not exist: create it (createdb) or fix the DSN's database name"
    elif isinstance(exc, asyncpg.InsufficientPrivilegeError):
        hint = (
            "the user may not do this (orchestra needs to create its schema `orchestra` and write "
            "its tables): grant it, or use a user that may"
        )
    elif isinstance(exc, ValueError | asyncpg.ClientConfigurationError):
        hint = "the DSN cannot be read: check its form (postgresql://user:password@host:port/db)"
    elif isinstance(exc, TimeoutError):
        hint = f"no answer within {_CONNECT_TIMEOUT:g} s: is the server up and reachable?"
    elif isinstance(exc, OSError | asyncpg.PostgresConnectionError | asyncpg.InterfaceError):
        hint = "cannot reach it, or the connection was lost: is the server running, and the DSN's host and port right?"
    else:
        hint = "it refused the request"
    return f"{at}: {hint} ({type(exc).__name__}: {exc})"
