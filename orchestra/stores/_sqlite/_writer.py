"""The SQLite store's writer: its one connection to the file, and the one thread that uses it.

Stdlib `sqlite3` in WAL mode with ``synchronous=NORMAL`` (a commit survives the process being
killed; a power cut may lose the last commits). The loop builds the rows (plain tuples) and hands
them over with the job that writes them; the thread runs it (``executemany``, then a commit) with
the GIL released inside SQLite. aiosqlite would be the same design (a thread per connection) with a
future per call; the stdlib needs no dependency and lets a window's batch be one call.

A job is a function of the connection first (`_writes`, `_admin`, `_leases`
hold them); a `sqlite3` error in it reaches its caller as a `StoreError` that says what is wrong
with the file (`explain`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from concurrent.futures import Future
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

from ..._exceptions import StoreError
from ._schema import migrate, refuse_foreign

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

__all__ = ("Writer", "explain")


class Writer:
    """The store's one connection and the one thread that uses it, fed through a queue.

    Written by hand rather than with a `ThreadPoolExecutor`: the store closes its connection from a
    `weakref.finalize` (a store nobody closed), which may run inside any allocation, even while the
    executor's own locks are held; `queue.SimpleQueue.put` is safe there (it is made for it), an
    executor's `submit` is not. A daemon thread: a store left open never keeps the interpreter
    from exiting (a transaction it was in is rolled back by SQLite; commits stay)."""

    def __init__(self, path: Path, busy_timeout: float = 10.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.jobs: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self.closed = False
        # The file it opened, as SQLite resolved it (a relative path against the working
        # directory then), and its (device, inode); None: no file (":memory:").
        self._file: tuple[str, int, int] | None = None

    def submit(self, job: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        if self.closed:  # no thread would ever answer: the caller would wait forever
            future.set_exception(
                StoreError(
                    f"database {str(self.path)!r}: its SQLiteStore was closed (store.close()): "
                    "open a new SQLiteStore on the file to use it again"
                )
            )
            return future
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name=f"orchestra-sqlite:{self.path.name}", daemon=True
            )
            self._thread.start()
        self.jobs.put((job, args, future))
        return future

    def stop(self) -> None:
        """No more jobs: the thread closes the connection after the ones already queued (safe
        in a `weakref.finalize`: an attribute set and a `SimpleQueue.put`)."""
        self.closed = True
        self.jobs.put(None)

    def _work(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while (item := self.jobs.get()) is not None:
                job, args, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if conn is None:
                        conn = self._connect()
                    else:
                        self._same_file()
                    result = job(conn, *args)
                except sqlite3.Error as exc:
                    error = StoreError(explain(exc, self.path))
                    error.__cause__ = exc
                    future.set_exception(error)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            if conn is not None:
                conn.close()

    def _connect(self) -> sqlite3.Connection:
        _refuse_tiny(self.path)
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=self.busy_timeout
        )
        try:
            refuse_foreign(conn, str(self.path))
            _wal(conn, self.busy_timeout)
            conn.execute("PRAGMA synchronous = NORMAL")
            migrate(conn, str(self.path))
        except BaseException:
            conn.close()
            raise
        where = os.path.abspath(self.path)
        try:
            found = os.stat(where)
        except FileNotFoundError:  # an in-memory database
            self._file = None
        else:
            self._file = (where, found.st_dev, found.st_ino)
        return conn

    def _same_file(self) -> None:
        """Refuse to go on when the path no longer names the file the connection has open: SQLite
        keeps writing to a deleted file (and its deleted WAL) without an error, and all of it is
        gone once the connection closes. One `stat` a job (a window): about a microsecond."""
        if self._file is None:
            return
        where, device, inode = self._file
        try:
            found = os.stat(where)
        except FileNotFoundError:
            how = "deleted"
        else:
            if found.st_ino == inode and found.st_dev == device:
                return
            how = "replaced"
        raise StoreError(
            f"database {str(self.path)!r}: the file was {how} while this SQLiteStore had it open "
            "(what it wrote since is not in the file at that path, and is lost when the store "
            "closes): nothing more is written. Put the run's file back at the path (from a "
            "backup) and open a new SQLiteStore on it to resume the run from what it holds; or "
            "start the run again on a new file"
        )


def _refuse_tiny(path: Path) -> None:
    """Refuse a non-empty file too short to be a SQLite database (a page is at least 512 bytes):
    SQLite takes a one-byte file for an empty database and writes a new one over it (a longer
    file without its header it refuses itself, "not a database"). A file that short is read by
    no SQLite connection, so this look at it cannot drop one's locks (closing any descriptor of a
    file drops the process's POSIX locks on it)."""
    try:
        size = os.stat(path).st_size
    except OSError:  # missing (created now), or not a file: SQLite says what is wrong
        return
    if 0 < size < 512:
        raise StoreError(
            f"database {str(path)!r}: it is not a SQLite database ({size} bytes, without "
            "SQLite's header): left as it is. Give a SQLiteStore a new path, or the path of "
            "its database file"
        )


def _wal(conn: sqlite3.Connection, busy_timeout: float) -> None:
    """Put the file in WAL mode, waiting up to `busy_timeout` for a lock held by another
    connection: SQLite answers this pragma SQLITE_BUSY at once, without its busy handler, while
    another process opens the same new file (a worker started with its coordinator)."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc).lower() or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)  # on the store's own thread: blocking it is what a busy wait does


def explain(exc: sqlite3.Error, path: Path) -> str:
    """What is wrong with the file, in words, from SQLite's error code (its message when the code
    says nothing more)."""
    message = str(exc)
    code = getattr(exc, "sqlite_errorname", None) or ""  # Python 3.11+: "SQLITE_IOERR_WRITE"
    lowered = message.lower()
    if code.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in lowered:
        hint = "another process holds it locked"
    elif code.startswith("SQLITE_READONLY") or "readonly" in lowered or "read-only" in lowered:
        hint = "it is read-only"
    elif code == "SQLITE_FULL" or "full" in lowered:
        hint = "the disk is full"
    elif code.startswith("SQLITE_IOERR") or "disk i/o error" in lowered:
        hint = (
            "writing or reading it failed: the disk may be full or failing, or the file may have "
            "reached a size limit"
        )
    elif (
        code.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))
        or "not a database" in lowered
        or "malformed" in lowered
        or "corrupt" in lowered
    ):
        hint = "it is not a SQLite database, or it is corrupt"
    elif code.startswith("SQLITE_CANTOPEN") or "unable to open" in lowered:
        hint = "it cannot be opened (does its directory exist?)"
    else:
        hint = "SQLite refused it"
    detail = f"{type(exc).__name__}: {message}" + (f", {code}" if code else "")
    return f"database {str(path)!r}: {hint} ({detail})"
