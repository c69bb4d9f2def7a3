"""The clock service: real `Clock` and `FakeClock` (virtual time for the running loop, so sleeps,
deadlines and cool-downs cost nothing, while real work off the loop still takes its real time),
and wall time for what is persisted."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.to_process
import anyio.to_thread
import pytest

from orchestra import (
    ConfigError,
    Context,
    Orchestrator,
    Rate,
    RetryPolicy,
    Task,
    agent,
)
from orchestra._clock import Clock, current_clock, loop_time
from orchestra.testing import FakeClock, scripted
from tests.helpers import fake_clock, run_recorded, tasks_of, trips_after

if TYPE_CHECKING:
    from collections.abc import Callable

REAL_WORK = 0.05  # seconds of real time each piece of off-loop work takes


@agent(kinds=["work"], executor="thread")
def sleeps_in_a_thread(task: Task) -> str:
    time.sleep(REAL_WORK)
    return "done"


@agent(kinds=["work"], executor="process")
def sleeps_in_a_process(task: Task) -> str:
    """Runs in a worker process: must be importable, hence at module top."""
    time.sleep(REAL_WORK)
    return "done"


def real_work() -> str:
    time.sleep(REAL_WORK)
    return "done"


class TestVirtualSleep:
    @pytest.mark.timeout(30)  # a real hour would be killed long before it ended
    async def test_an_hour_of_asyncio_sleep_is_instant(self) -> None:
        async with fake_clock() as c:
            before = c.time()
            await asyncio.sleep(3600)
            assert c.time() - before == pytest.approx(3600)
            assert asyncio.get_running_loop().time() == c.time()

    @pytest.mark.timeout(30)
    async def test_anyio_sleep_and_current_time_are_virtual(self) -> None:
        async with fake_clock() as c:
            before = anyio.current_time()
            await anyio.sleep(86_400)
            assert anyio.current_time() - before == pytest.approx(86_400)
            assert anyio.current_time() == c.time()

    async def test_sleepers_wake_in_deadline_order_at_their_virtual_times(self) -> None:
        woke: list[tuple[str, float]] = []
        async with fake_clock() as c:
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
        async with fake_clock() as c:
            before = c.time()
            for _ in range(100):
                await asyncio.sleep(0)
            assert c.time() == before


class TestLargeLoopTimes:
    """The loop's clock is the machine's uptime. From 2**24 s (194 days) on, a float's step there
    is wider than twice the clock's resolution (1 ns), and asyncio runs a timer only while
    ``when < time() + resolution``: a sum that then rounds back to ``time()``."""

    @pytest.mark.timeout(20)  # the failure is a hang: the timer due now never ran
    @pytest.mark.parametrize("start", [2.0**24 + 0.5, 33_000_000.0, 2.0**25 - 0.5, 1.7e9])
    async def test_sleeps_end_whatever_the_start(self, start: float) -> None:
        async with FakeClock(start=start) as c:
            await asyncio.sleep(1)  # 2**25 - 0.5: the float step doubles during this one
            await anyio.sleep(0.1)
            with anyio.move_on_after(0.25):
                await anyio.sleep(10)
            assert c.time() == pytest.approx(start + 1.35, abs=4 * math.ulp(start + 2))


class TestTies:
    """Timers due at the same virtual time run in the order they were set, whatever the loop ran
    before: what a seeded run needs to replay exactly in the same process."""

    async def test_timers_due_at_the_same_time_run_in_the_order_they_were_set(
        self, clock: FakeClock
    ) -> None:
        loop = asyncio.get_running_loop()
        ran: list[int] = []
        at = clock.time() + 1
        for i in range(8):
            loop.call_at(at, ran.append, i)
        await asyncio.sleep(2)
        assert ran == list(range(8))

    async def test_sleepers_due_together_wake_in_the_order_they_slept_across_a_purge(
        self, clock: FakeClock
    ) -> None:
        # Enough cancelled timers that asyncio purges its timer heap while the sleepers wait:
        # the purge rebuilds the heap, which must not reorder them.
        loop = asyncio.get_running_loop()
        woke: list[int] = []
        at = clock.time() + 5

        async def sleeper(i: int) -> None:
            await anyio.sleep_until(at)
            woke.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(120):
                tg.start_soon(sleeper, i)
            await anyio.sleep(1)
            for _ in range(200):
                loop.call_at(at + 1, woke.append, -1).cancel()
            await anyio.sleep(1)  # a loop turn with the cancelled timers in the heap: it purges
        assert woke == list(range(120))


class TestDeadlines:
    async def test_fail_after_fires_in_fake_time(self) -> None:
        async with fake_clock() as c:
            before = c.time()
            with pytest.raises(TimeoutError):
                with anyio.fail_after(10):
                    await anyio.sleep(1000)
            assert c.time() - before == pytest.approx(10)

    async def test_move_on_after_lets_a_shorter_sleep_finish(self) -> None:
        async with fake_clock() as c:
            before = c.time()
            with anyio.move_on_after(10) as scope:
                await anyio.sleep(4)
            assert not scope.cancelled_caught
            assert c.time() - before == pytest.approx(4)

    async def test_asyncio_wait_for_times_out_in_fake_time(self) -> None:
        async with fake_clock() as c:
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

    async def test_a_timer_pending_at_uninstall_keeps_what_is_left_of_its_delay(self) -> None:
        # A loop that outlives the clock (a module-scoped pytest-asyncio loop) with a task still
        # asleep: it wakes after what was left of its sleep, in real time, not 100 s later.
        async with FakeClock():
            sleeper = asyncio.ensure_future(asyncio.sleep(100.05))
            await asyncio.sleep(100)
        started = time.monotonic()
        with anyio.fail_after(5):
            await sleeper
        assert time.monotonic() - started < 1

    async def test_a_given_start_is_where_virtual_time_starts(self) -> None:
        start = 559893.2372771676  # a CI host's uptime
        clock = FakeClock(start=start)
        assert clock.now() == start  # before the install too
        async with clock:
            assert asyncio.get_running_loop().time() == start
            wall = clock.wall()
            assert wall == pytest.approx(time.time(), abs=5)  # wall time is still the real one
            await asyncio.sleep(30)
            assert clock.now() == start + 30
            assert clock.wall() - wall == pytest.approx(30)
        async with clock:  # every install starts there, as one without `start` starts at the loop's
            assert clock.now() == start

    async def test_a_runs_clock_reader_is_the_fake_clock_while_one_is_installed(self) -> None:
        loop = asyncio.get_running_loop()
        assert loop_time(loop) is time.monotonic  # asyncio's own loop: its clock, read directly
        async with fake_clock() as clock:
            read = loop_time(loop)
            start = read()
            await asyncio.sleep(50)
            assert read() == pytest.approx(start + 50) == pytest.approx(clock.now())

    async def test_installs_nest_and_the_last_uninstall_restores(self) -> None:
        loop = asyncio.get_running_loop()
        clock = fake_clock()
        clock.install()
        clock.install()
        clock.uninstall()
        assert "time" in vars(loop)
        clock.uninstall()
        assert "time" not in vars(loop)
        clock.uninstall()  # one too many is harmless

    def test_installing_outside_async_code_says_how_to_install_it(self) -> None:
        with pytest.raises(ConfigError, match="async with FakeClock"):
            FakeClock().install()

    async def test_a_second_fake_clock_on_the_same_loop_is_refused(self, clock: FakeClock) -> None:
        with pytest.raises(ConfigError, match="FakeClock"):
            fake_clock().install()
        await asyncio.sleep(1)  # the first clock still works
        assert clock.time() > 0

    async def test_orchestrator_installs_its_clock_for_its_lifetime(
        self, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        loop = asyncio.get_running_loop()
        fake = fake_clock()
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
        async with fake_clock(autojump_threshold=1.0) as c:
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


async def start_a_worker_process() -> None:
    """Leave an idle anyio worker process on the test's loop, which has imported this module.

    A worker's start (a fresh interpreter importing orchestra, pytest and this module: seconds
    on a loaded machine) is not the work these tests time. And anyio (4.16) leaks a worker whose
    start is cancelled (an attempt timeout): never killed, never waited for, its `Popen` and pipes
    collected in a later test as ResourceWarnings (agronholm/anyio#1337); cancelled once started,
    the worker is killed and reaped."""
    assert await anyio.to_process.run_sync(real_work) == "done"


async def in_a_process() -> str:
    return await anyio.to_process.run_sync(real_work, cancellable=True)


class TestRealWorkOffTheLoop:
    """Threads and worker processes take real time; the clock waits for them instead of jumping."""

    @pytest.mark.parametrize(
        "worker",
        [
            pytest.param(sleeps_in_a_thread, id="thread"),
            pytest.param(sleeps_in_a_process, id="process", marks=pytest.mark.subprocess),
        ],
    )
    async def test_real_work_under_a_long_attempt_timeout_succeeds(
        self, worker: object, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        if worker is sleeps_in_a_process:
            await start_a_worker_process()
        orch = make_orchestrator(
            agents=[worker], timeouts={"attempt": 5}, retry=RetryPolicy(max_attempts=1)
        )
        result = await orch.run(tasks=[Task("work", 1, id="t")])
        assert result.status == "success", result.errors
        assert result.data == {"t": "done"}
        # Virtual time passed at the real pace while the loop waited for the work, not 5 s at once.
        assert 0 < result.metadata.elapsed < 5

    @pytest.mark.parametrize(
        "worker",
        [
            pytest.param(sleeps_in_a_thread, id="thread"),
            pytest.param(sleeps_in_a_process, id="process", marks=pytest.mark.subprocess),
        ],
    )
    async def test_real_work_under_a_shorter_attempt_timeout_times_out(
        self, worker: object, clock: FakeClock, make_orchestrator: Callable[..., Orchestrator]
    ) -> None:
        if worker is sleeps_in_a_process:
            await start_a_worker_process()
        orch = make_orchestrator(
            agents=[worker], timeouts={"attempt": 0.01}, retry=RetryPolicy(max_attempts=1)
        )
        result, done, _ = await run_recorded(orch, [Task("work", 1, id="t")])
        assert result.status != "success"
        failures = done["t"].failures
        assert failures is not None
        assert [f.error_type for f in failures] == ["AttemptTimeout"]
        if worker is sleeps_in_a_process:
            # The attempt ends once anyio has killed and reaped its worker: real time, which the
            # clock lets pass (and 0.01 itself, up to float rounding, when that is quick).
            assert 0.0099 < failures[0].duration < 5
        else:
            assert failures[0].duration == pytest.approx(0.01)

    @pytest.mark.parametrize(
        "start",
        [
            lambda: anyio.to_thread.run_sync(real_work, abandon_on_cancel=True),
            lambda: asyncio.get_running_loop().run_in_executor(None, real_work),
            lambda: asyncio.to_thread(real_work),
            pytest.param(in_a_process, marks=pytest.mark.subprocess),
        ],
        ids=["anyio.to_thread", "run_in_executor", "asyncio.to_thread", "anyio.to_process"],
    )
    async def test_every_way_off_the_loop_beats_a_far_deadline(
        self, start: Callable[[], object], clock: FakeClock
    ) -> None:
        if start is in_a_process:
            await start_a_worker_process()
        before = clock.now()
        with anyio.fail_after(5):
            assert await start() == "done"  # type: ignore[misc]
        assert 0 < clock.now() - before < 5  # the real time the loop waited for it
        assert not clock.in_flight()

    async def test_time_jumps_again_once_the_work_is_done(self, clock: FakeClock) -> None:
        await anyio.to_thread.run_sync(real_work)
        before, real_before = clock.now(), time.monotonic()
        await anyio.sleep(30)  # a 30 s backoff
        assert clock.now() - before == pytest.approx(30)
        assert time.monotonic() - real_before < 5  # jumped, did not wait

    async def test_a_thread_abandoned_by_its_timeout_does_not_hold_the_clock(
        self, clock: FakeClock
    ) -> None:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.01):
                await anyio.to_thread.run_sync(time.sleep, 0.2, abandon_on_cancel=True)
        assert not clock.in_flight()  # the thread still sleeps; nobody waits for it

    async def test_work_the_clock_cannot_see_is_declared_with_real_work(
        self, clock: FakeClock
    ) -> None:
        loop = asyncio.get_running_loop()

        async def answer_from_a_thread_of_our_own() -> str:
            done: asyncio.Future[str] = loop.create_future()

            def work() -> None:
                time.sleep(REAL_WORK)
                loop.call_soon_threadsafe(done.set_result, "done")

            threading.Thread(target=work).start()
            with anyio.fail_after(5):
                return await done

        with pytest.raises(TimeoutError):  # unseen: the clock jumps 5 s at once
            await answer_from_a_thread_of_our_own()
        await anyio.to_thread.run_sync(time.sleep, 2 * REAL_WORK)  # let that thread end
        with clock.real_work():
            assert clock.in_flight()
            assert await answer_from_a_thread_of_our_own() == "done"
        assert not clock.in_flight()


class TestWallTime:
    async def test_the_real_clock_reads_the_loop_and_the_epoch(self) -> None:
        real = current_clock()
        assert type(real) is Clock
        assert real.now() == pytest.approx(asyncio.get_running_loop().time(), abs=0.01)
        assert Clock().now() == pytest.approx(time.monotonic(), abs=0.01)
        assert real.wall() == pytest.approx(time.time(), abs=0.01)
        t = real.now() + 30
        assert real.to_wall(t) == pytest.approx(time.time() + 30, abs=0.01)
        assert real.to_loop(real.to_wall(t)) == pytest.approx(t, abs=0.01)

    async def test_the_current_clock_is_the_installed_fake_clock(self, clock: FakeClock) -> None:
        assert current_clock() is clock
        clock.uninstall()
        assert type(current_clock()) is Clock
        clock.install()

    async def test_fake_wall_time_starts_at_the_real_wall_time(self, clock: FakeClock) -> None:
        assert isinstance(clock, Clock)
        assert clock.wall() == pytest.approx(time.time(), abs=1)
        assert clock.now() == asyncio.get_running_loop().time()

    async def test_fake_wall_time_advances_by_exactly_the_virtual_jump(
        self, clock: FakeClock
    ) -> None:
        wall, now = clock.wall(), clock.now()
        await anyio.sleep(3600)
        assert clock.now() - now == pytest.approx(3600)
        # Exact to the precision of an epoch float (2**-22 s near 2026): the same offset throughout.
        assert clock.wall() - wall == pytest.approx(clock.now() - now, abs=1e-6)
        assert clock.wall() == clock.to_wall(clock.now())

    async def test_a_persisted_due_time_is_due_when_the_loop_reaches_it(
        self, clock: FakeClock
    ) -> None:
        due = clock.now() + 30  # a backoff on the loop clock...
        stored = clock.to_wall(due)  # ...persisted as wall time
        await anyio.sleep(29.5)
        assert clock.wall() < stored
        await anyio.sleep(0.5)
        assert clock.wall() >= stored
        assert clock.to_loop(stored) == pytest.approx(due, abs=1e-6)

    async def test_time_stands_still_outside_an_install(self) -> None:
        fake = fake_clock()
        async with fake:
            await asyncio.sleep(10)
        now, wall = fake.now(), fake.wall()
        await asyncio.sleep(0.01)
        assert (fake.now(), fake.wall()) == (now, wall)


class TestStateKeptAcrossClocks:
    """A rate limit or an orchestrator kept at module level sees a `FakeClock`'s virtual time in
    one test and the real clock in the next: what it remembers of the first (virtual time runs far
    ahead of the real one) must not make the second wait it out."""

    @pytest.mark.timeout(30)
    async def test_a_rate_used_under_a_fake_clock_is_empty_on_the_real_one(self) -> None:
        key = [Rate(60, per=60)]  # one request a second

        @agent(kinds=["work"], limits=key)
        async def call(task: Task, ctx: Context) -> int:
            return 1

        async with FakeClock() as fake:
            before = fake.now()
            result = await Orchestrator(agents=[call]).run(tasks=tasks_of(120))
            assert result.status == "success"
            assert fake.now() - before == pytest.approx(119, abs=1)  # its pace, in virtual time
        with anyio.fail_after(5):  # real seconds: the meter's two virtual minutes are not ours
            result = await Orchestrator(agents=[call]).run(tasks=tasks_of(1))
        assert result.status == "success"

    @pytest.mark.timeout(30)
    async def test_a_breaker_opened_under_a_fake_clock_has_cooled_down_on_the_real_one(
        self,
    ) -> None:
        flaky = scripted("flaky", ["work"], fail_first=1, latency=10.0)
        orch = Orchestrator(
            agents=[flaky],
            retry=RetryPolicy(max_attempts=1),
            breaker=trips_after(1, cooldown=30),
        )
        async with FakeClock():
            failed = await orch.run(tasks=tasks_of(1))  # fails at virtual +10 s: open
        assert failed.status == "failed"
        assert orch.agents_status()[0]["breaker"] == "open"
        flaky.latency = 0.0
        with anyio.fail_after(5):  # real seconds: not the 40 the virtual opening would leave
            result = await orch.run(tasks=tasks_of(1))
        assert result.status == "success"
