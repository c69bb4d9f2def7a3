"""Wake-ups on PostgreSQL (`orchestra.stores._postgres._listen`), on real servers: a listener called
back on its run's channel and the global one when a NOTIFY commits, and one that comes back by
itself, listening again, when its server is stopped and started again under it; the poll that
stands behind it."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import pytest

from orchestra.stores._postgres._listen import (
    GLOBAL_CHANNEL,
    Listener,
    Wakeup,
    channel_of,
    notify,
)
from orchestra.stores._postgres._server import embedded_server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from orchestra.testing import FakeClock

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.postgres,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX only"),
]


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


class Heard:
    """The notifications a listener delivered, and a way to wait for the next."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.reconnected = 0
        self._more = anyio.Event()

    def __call__(self, channel: str, payload: str) -> None:
        self.items.append((channel, payload))
        self._more.set()

    def reconnect(self) -> None:
        self.reconnected += 1
        self._more.set()

    async def until(self, count: int) -> list[tuple[str, str]]:
        with anyio.fail_after(10):
            while len(self.items) < count:
                await self._more.wait()
                self._more = anyio.Event()
        return self.items


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


class TestChannels:
    def test_a_run_has_its_own_channel_within_the_name_limit(self) -> None:
        assert channel_of("contracts") == "orchestra:contracts"
        long = channel_of("x" * 100)
        assert long.startswith("orchestra:#")
        assert len(long.encode()) <= 63
        assert long != channel_of("x" * 101)


class TestListener:
    async def test_hears_its_runs_notifications_and_the_global_channels(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        heard = Heard()
        async with Listener(pg_dsn, [channel_of("r"), GLOBAL_CHANNEL], on_notify=heard) as listener:
            assert listener.connected
            await notify(conn, "r", "ready")
            assert sorted(await heard.until(2)) == [("orchestra", "r"), ("orchestra:r", "ready")]
            await notify(conn, "other", "ready")
            assert (await heard.until(3))[-1] == ("orchestra", "other")
        assert not listener.connected

    async def test_a_notification_in_a_transaction_arrives_when_it_commits(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        heard = Heard()
        async with Listener(pg_dsn, [channel_of("r")], on_notify=heard):
            async with conn.transaction():
                await notify(conn, "r", "ready")
                await anyio.sleep(0.2)
                assert heard.items == []
            assert await heard.until(1) == [("orchestra:r", "ready")]

    async def test_a_long_run_id_is_heard_on_its_hashed_channel(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        heard = Heard()
        run_id = "a-run-id-" + "x" * 80
        async with Listener(pg_dsn, [channel_of(run_id)], on_notify=heard):
            await notify(conn, run_id, "ready")
            assert await heard.until(1) == [(channel_of(run_id), "ready")]

    async def test_a_first_connection_that_fails_raises(self) -> None:
        with pytest.raises(OSError):
            async with Listener("postgresql://postgres@127.0.0.1:9/none", [], on_notify=print):
                pass


class TestAListenerWhoseServerRestarts:
    async def test_reconnects_listens_again_and_hears_the_next_notification(self) -> None:
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)  # reachable by the server's user when root
            directory = Path(parent) / "data"
            server = embedded_server(directory, durable=False)
            port = server.port
            heard = Heard()
            try:
                async with Listener(
                    server.dsn,
                    [channel_of("r")],
                    on_notify=heard,
                    on_reconnect=heard.reconnect,
                    backoff=0.05,
                    max_backoff=0.2,
                ) as listener:
                    await anyio.to_thread.run_sync(server.stop)
                    await until(lambda: not listener.connected)
                    await anyio.sleep(0.5)  # a few failed tries: the backoff is at its cap
                    server = await anyio.to_thread.run_sync(
                        lambda: embedded_server(directory, durable=False, port=port)
                    )
                    await until(lambda: listener.connected and heard.reconnected > 0)
                    assert listener.reconnects == 1
                    conn = await asyncpg.connect(server.dsn)
                    try:
                        await notify(conn, "r", "after the restart")
                        assert await heard.until(1) == [("orchestra:r", "after the restart")]
                    finally:
                        await conn.close()
            finally:
                server.stop()


class TestWakeup:
    async def test_a_notification_ends_the_wait_and_is_used_up(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        wakeup = Wakeup()
        async with Listener(pg_dsn, [channel_of("r")], on_notify=wakeup.set):
            await notify(conn, "r")
            assert await wakeup.wait(10)
        assert not await wakeup.wait(0.05)  # nothing more: the poll interval passes

    async def test_the_wait_ends_at_the_poll_interval_without_one(self, clock: FakeClock) -> None:
        wakeup = Wakeup()
        started = clock.time()
        assert not await wakeup.wait(30)
        assert clock.time() - started == pytest.approx(30)

    async def test_a_wake_before_the_wait_is_kept_for_it(self, clock: FakeClock) -> None:
        wakeup = Wakeup()
        wakeup.set("orchestra:r", "ready")
        started = clock.time()
        assert await wakeup.wait(30)
        assert clock.time() == started


class TestAWakeupFromAnotherThread:
    """The store's thread hears a notification and wakes the run's loop (`Wakeup.set_from`)."""

    async def test_each_wake_after_the_last_was_used_reaches_the_waiter(self) -> None:
        loop = asyncio.get_running_loop()
        wakeup = Wakeup()
        for _ in range(3):
            await anyio.to_thread.run_sync(wakeup.set_from, loop)
            assert await wakeup.wait(10)
        assert not await wakeup.wait(0.05)

    async def test_a_burst_while_the_waiter_is_away_costs_one_hop(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        loop = asyncio.get_running_loop()
        hops: list[Any] = []
        hop = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            hops.append(callback)
            return hop(callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        wakeup = Wakeup()

        def burst() -> None:
            for _ in range(100):
                wakeup.set_from(loop)

        thread = threading.Thread(target=burst)
        thread.start()
        thread.join()  # (the loop does not run meanwhile: every wake finds the waiter away)
        assert len(hops) == 1
        assert await wakeup.wait(10)
        assert not await wakeup.wait(0.05)  # one wake, used up
