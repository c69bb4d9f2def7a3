"""Wake-ups on PostgreSQL: LISTEN/NOTIFY on a dedicated connection that comes back by itself, and
the poll that stands behind it.

A process that waits for work (a worker with nothing to claim, a coordinator waiting for its run's
end) listens on its run's channel (`channel_of`) and on the global one (`GLOBAL_CHANNEL`, for
processes that serve any run), and is called back the moment a transaction that made work
(`notify`: tasks made ready, a run admitted) commits. A notification is a hint, never the state:
one sent while the listener was away is lost, so the owner also polls (`Wakeup.wait`), and looks
again at once when the listener comes back (its `on_reconnect`).

`Listener` holds one asyncpg connection of its own (notifications arrive on the connection that
listens, so it cannot be a pool's). When that connection is lost (a database restart, a network
cut, a server that ended the session), it connects again after a backoff (doubling from `backoff`
up to `max_backoff`, with jitter so that many processes do not come back at once) and listens
again; a connection that went silent without closing is found by a ``SELECT 1`` every `ping`
seconds.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Final

import anyio
import asyncpg

from ._background import Background

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Sequence
    from types import TracebackType


__all__ = ("ENDED", "GLOBAL_CHANNEL", "Listener", "Wakeup", "channel_of", "notify")

GLOBAL_CHANNEL: Final = "orchestra"
"""The channel every run's notifications also go to (their payload: the run id)."""

ENDED: Final = "ended"
"""The payload on a run's channel when another process wrote ends of it (`_leases.complete`):
news for the run's coordinator, which follows them; nothing for a worker to claim."""

_MAX_CHANNEL: Final = 63  # PostgreSQL's identifiers (and so channel names) are at most 63 bytes


def channel_of(run_id: str) -> str:
    """The channel of `run_id`'s notifications: ``orchestra:<run id>``, or, for a run id too long
    for a channel name, ``orchestra:#<its sha1>``."""
    name = f"{GLOBAL_CHANNEL}:{run_id}"
    if len(name.encode()) <= _MAX_CHANNEL:
        return name
    return f"{GLOBAL_CHANNEL}:#{hashlib.sha1(run_id.encode()).hexdigest()}"


async def notify(conn: asyncpg.Connection, run_id: str, payload: str = "") -> None:
    """Tell the listeners of `run_id` (`payload` on its channel) and of every run (the run id on
    `GLOBAL_CHANNEL`). Inside a transaction, delivered when it commits, not before."""
    await conn.execute(
        "SELECT pg_notify($1, $2), pg_notify($3, $4)",
        channel_of(run_id), payload, GLOBAL_CHANNEL, run_id,
    )  # fmt: skip


class Wakeup:
    """What an owner waits on between looks: set by notifications (and by anything else that
    knows of work), else the poll interval passes."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._coming = False  # a `set_from` on its way to the waiter's loop

    def set(self, *_: object) -> None:
        """Wake the waiter (any arguments ignored: usable as a listener's callback)."""
        self._event.set()

    def set_from(self, loop: asyncio.AbstractEventLoop) -> None:
        """`set`, from another thread than the waiter's (whose loop is `loop`): a notification
        heard in the store's thread. Each hop costs both threads a wake-up (a write to the
        loop's self-pipe, a turn of the loop), and a busy run's notifications come by the
        hundred while it waits out its pace: a hop goes only when the waiter is not woken
        already and none is on its way. (Read from this thread, the flags are at worst stale
        the safe way: the waiter clears them before it looks, and looks after this.)"""
        if self._coming or self._event.is_set():
            return
        self._coming = True
        loop.call_soon_threadsafe(self._arrive)

    def _arrive(self) -> None:
        self._coming = False
        self._event.set()

    async def wait(self, poll: float) -> bool:
        """Wait until woken or `poll` seconds pass; True when woken. The wake-up is used up."""
        with anyio.move_on_after(poll):
            await self._event.wait()
        woken = self._event.is_set()
        if woken:
            self._event = anyio.Event()
        return woken


class Listener:
    """Listens on `channels` of the database at `dsn` while open, calling `on_notify(channel,
    payload)` for each notification and `on_reconnect()` each time it listens again after a lost
    connection (what was sent meanwhile is lost: look again). `connected` says whether it
    listens now: while it does not, the owner should poll more often.

    ``async with Listener(dsn, [channel_of(run_id), GLOBAL_CHANNEL], on_notify=...) as listener:``
    returns once it listens (or raises, when the first connection fails).
    """

    def __init__(
        self,
        dsn: str,
        channels: Sequence[str],
        *,
        on_notify: Callable[[str, str], object],
        on_reconnect: Callable[[], object] | None = None,
        backoff: float = 0.05,
        max_backoff: float = 5.0,
        ping: float = 10.0,
    ) -> None:
        self.connected = False
        self.reconnects = 0
        self._dsn = dsn
        self._channels = tuple(channels)
        self._on_notify = on_notify
        self._on_reconnect = on_reconnect
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._ping = ping
        self._background = Background()

    async def __aenter__(self) -> Listener:
        conn = await self._listen()
        await self._background.start(self._keep_listening, conn)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._background.stop(exc_type, exc, tb)

    def _deliver(self, _conn: object, _pid: int, channel: str, payload: object) -> None:
        self._on_notify(channel, str(payload))

    async def _listen(self) -> asyncpg.Connection:
        conn = await asyncpg.connect(self._dsn)
        try:
            for channel in self._channels:
                await conn.add_listener(channel, self._deliver)
        except BaseException:
            conn.terminate()
            raise
        self.connected = True
        return conn

    async def _keep_listening(self, conn: asyncpg.Connection) -> None:
        try:
            while True:
                await self._until_lost(conn)
                self.connected = False
                conn.terminate()
                conn = await self._reconnect()
                self.reconnects += 1
                if self._on_reconnect is not None:
                    self._on_reconnect()
        finally:
            self.connected = False
            conn.terminate()

    async def _until_lost(self, conn: asyncpg.Connection) -> None:
        """Return once `conn` is closed, or no longer answers within `ping` seconds."""
        lost = anyio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        while not conn.is_closed():
            with anyio.move_on_after(self._ping):
                await lost.wait()
            if lost.is_set() or conn.is_closed():
                return
            try:
                with anyio.fail_after(self._ping):
                    await conn.fetchval("SELECT 1")
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                return

    async def _reconnect(self) -> asyncpg.Connection:
        delay = self._backoff
        while True:
            # Full jitter over the upper half: many listeners do not all come back at once.
            await anyio.sleep(random.uniform(delay / 2, delay))
            try:
                return await self._listen()
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                delay = min(self._max_backoff, delay * 2)
