"""FakeClock: virtual time for the running loop, so sleeps, deadlines and cool-downs cost nothing."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread
import pytest

from orchestra import ConfigError, Orchestrator, Task
from orchestra.testing import FakeClock, scripted

if TYPE_CHECKING:
    from collections.abc import Callable


class TestVirtualSleep:
    @pytest.mark.timeout(30)  # a real hour would be killed long before it ended
    async def test_an_hour_of_asyncio_sleep_is_instant(self) -> None:
        async with FakeClock() as c:
            before = c.time()
            await asyncio.sleep(3600)
            assert c.time() - before == pytest.approx(3600)
            assert asyncio.get_running_loop().time() == c.time()

    @pytest.mark.timeout(30)
    async def test_anyio_sleep_and_current_time_are_virtual(self) -> None:
        async with FakeClock() as c:
            before = anyio.current_time()
            await anyio.sleep(86_400)
            assert anyio.current_time() - before == pytest.approx(86_400)
            assert anyio.current_time() == c.time()

    async def test_sleepers_wake_in_deadline_order_at_their_virtual_times(self) -> None:
        woke: list[tuple[str, float]] = []
        async with FakeClock() as c:
            t0 = c.time()

            async def sleeper(name: str, seconds: float) -> None:
                await anyio.sleep(seconds)
                woke.append((name, c.time() - t0))

            async with anyio.create_task_group() as tg:
                tg.start_soon(sleeper, "c", 30.0)
                tg.start_soon(sleeper, "a", 10.0)
                tg.start_soon(sleeper, "b", 20.0)
        assert [name for name, _ in woke] == ["a", "b", "c"]
        assert [at for _, at in woke] == pytest.approx([10.0, 20.0, 30.0])

    async def test_time_does_not_move_while_work_is_ready(self) -> None:
        async with FakeClock() as c:
            before = c.time()
            for _ in range(100):
                await asyncio.sleep(0)
            assert c.time() == before


class TestDeadlines:
    async def test_fail_after_fires_in_fake_time(self) -> None:
        async with FakeClock() as c:
            before = c.time()
            with pytest.raises(TimeoutError):
                with anyio.fail_after(10):
                    await anyio.sleep(1000)
            assert c.time() - before == pytest.approx(10)

    async def test_move_on_after_lets_a_shorter_sleep_finish(self) -> None:
        async with FakeClock() as c:
            before = c.time()
            with anyio.move_on_after(10) as scope:
                await anyio.sleep(4)
            assert not scope.cancelled_caught
            assert c.time() - before == pytest.approx(4)

    async def test_asyncio_wait_for_times_out_in_fake_time(self) -> None:
        async with FakeClock() as c:
            before = c.time()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.sleep(500), timeout=7)
            assert c.time() - before == pytest.approx(7)


class TestInstallation:
    async def test_starts_at_the_loops_time_and_restores_the_real_clock(self) -> None:
        loop = asyncio.get_running_loop()
        clock = FakeClock()
        async with clock:
            assert "time" in vars(loop)
            start = clock.time()
            await asyncio.sleep(100)
            assert clock.time() == pytest.approx(start + 100)
        assert "time" not in vars(loop)  # back to the real, monotonic clock
        real = loop.time()
        assert real == pytest.approx(time.monotonic(), abs=5)

    async def test_installs_nest_and_the_last_uninstall_restores(self) -> None:
        loop = asyncio.get_running_loop()
        clock = FakeClock()
        clock.install()
        clock.install()
        clock.uninstall()
        assert "time" in vars(loop)
        clock.uninstall()
        assert "time" not in vars(loop)
        clock.uninstall()  # one too many is harmless

    async def test_a_second_fake_clock_on_the_same_loop_is_refused(self, clock: FakeClock) -> None:
        with pytest.raises(ConfigError, match="FakeClock"):
            FakeClock().install()
        await asyncio.sleep(1)  # the first clock still works
        assert clock.time() > 0

    async def test_orchestrator_installs_its_clock_for_its_lifetime(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        loop = asyncio.get_running_loop()
        fake = FakeClock()
        slow = scripted("slow", ["work"], latency=3600)
        orch = make_orchestrator(agents=[slow], clock=fake)
        async with orch:
            assert "time" in vars(loop)
            result = await orch.run(tasks=[Task("work", 1)])
        assert "time" not in vars(loop)
        assert result.status == "success"
        assert result.metadata.elapsed == pytest.approx(3600)

    async def test_a_thread_finishing_is_seen_before_a_timer_with_an_autojump_threshold(
        self,
    ) -> None:
        # With a threshold, the loop waits that long in real time for I/O before jumping: a worker
        # thread (real time) finishes before a far virtual timer fires.
        async with FakeClock(autojump_threshold=1.0) as c:
            before = c.time()
            order: list[str] = []

            async def timer() -> None:
                await anyio.sleep(1000)
                order.append("timer")

            async def thread() -> None:
                await anyio.to_thread.run_sync(time.sleep, 0.001)
                order.append("thread")

            async with anyio.create_task_group() as tg:
                tg.start_soon(timer)
                tg.start_soon(thread)
            assert order == ["thread", "timer"]
            assert c.time() - before == pytest.approx(1000)
