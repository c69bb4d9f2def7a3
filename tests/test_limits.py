"""Limits: one protocol for the global limit, per-agent limits and rate limits. Reserve before an
attempt ("go", "room at T" or "room after a release"), reconcile after it, release on every exit;
a 429's Retry-After holds everybody who shares the limiter. Time is handed in, never read."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import pytest

from orchestra._concurrency import Concurrency
from orchestra._limits import LAPSE, Limiter, reserve_all
from orchestra._rate import Rate
from tests.limit_helpers import Counter, admit_greedily, in_window

if TYPE_CHECKING:
    from orchestra.testing import FakeClock


class TestHold:
    def test_nobody_gets_room_before_the_hold_ends(self) -> None:
        limit = Concurrency(5)
        limit.hold_until(30.0)
        assert limit.reserve(10.0, 1) == 30.0
        assert limit.peek(10.0, 1) == 30.0
        assert limit.reserve(30.0, 1) == 0.0

    def test_a_rate_hold_wins_over_its_own_room(self) -> None:
        rate = Rate(60, per=60)
        rate.hold_until(12.5)
        assert rate.reserve(0.0, 1) == 12.5
        assert rate.reserve(12.5, 1) == 0.0
        assert rate.reserve(12.5, 1) == 13.5

    def test_a_shorter_or_nan_hold_never_shortens_one(self) -> None:
        for limiter in (Concurrency(1), Rate(1, per=1)):
            limiter.hold_until(20.0)
            limiter.hold_until(5.0)
            limiter.hold_until(math.nan)
            assert limiter.reserve(10.0, 1) == 20.0

    def test_a_hold_on_a_shared_limiter_holds_every_sharer(self) -> None:
        shared = Rate(100, per=1, burst=10)
        agent_a: list[Limiter] = [Concurrency(4), shared]
        agent_b: list[Limiter] = [Concurrency(4), shared]
        assert reserve_all(agent_a, 0.0, 1) == 0.0
        shared.hold_until(2.0)  # agent a got a 429 with Retry-After: 2
        assert reserve_all(agent_b, 0.5, 1) == 2.0
        assert reserve_all(agent_a, 0.5, 1) == 2.0
        assert reserve_all(agent_b, 2.0, 1) == 0.0


class TestReserveAll:
    def test_takes_from_every_limiter(self) -> None:
        outer, inner = Concurrency(2), Concurrency(1)
        rate = Rate(10, per=1, burst=5)
        assert reserve_all([outer, inner, rate], 0.0, 1) == 0.0
        assert (outer.in_use, inner.in_use, rate.in_use(0.0)) == (1, 1, 1)

    def test_a_no_gives_back_what_the_others_took(self) -> None:
        outer, rate, inner = Concurrency(5), Rate(1, per=1), Concurrency(1)
        inner.reserve(0.0, 1)
        assert reserve_all([outer, rate, inner], 0.0, 1) == math.inf
        assert outer.in_use == 0
        assert rate.reserve(0.0, 1) == 0.0, "the rate's unit was given back"

    def test_answers_the_latest_room_of_all(self) -> None:
        slow, fast = Rate(1, per=10), Rate(1, per=2)
        slow.reserve(0.0, 1)
        fast.reserve(0.0, 1)
        assert reserve_all([fast, slow], 0.0, 1) == 10.0
        assert reserve_all([slow, fast], 0.0, 1) == 10.0

    def test_room_only_after_a_release_outranks_a_time(self) -> None:
        rate, full = Rate(1, per=10), Concurrency(1)
        rate.reserve(0.0, 1)
        full.reserve(0.0, 1)
        assert reserve_all([rate, full], 0.0, 1) == math.inf

    def test_watches_the_limiters_that_need_a_release(self) -> None:
        free, full = Concurrency(3), Concurrency(1)
        full.reserve(0.0, 1)
        wake = Counter()
        assert reserve_all([free, full], 0.0, 1, wake) == math.inf
        free.reserve(0.0, 1)
        free.release(1, 1.0)
        assert wake.calls == 0, "only the limiter that said no is watched"
        full.release(1, 1.0)
        assert wake.calls == 1
        assert reserve_all([free, full], 1.0, 1, wake) == 0.0

    def test_does_not_watch_when_room_comes_with_time(self) -> None:
        rate = Rate(1, per=5)
        rate.reserve(0.0, 1)
        wake = Counter()
        assert reserve_all([rate], 0.0, 1, wake) == 5.0
        rate.reconcile(1, 0, 1.0)
        assert wake.calls == 0

    def test_per_unit_limits_each_read_their_unit(self) -> None:
        slots = Concurrency(10)
        key: list[Limiter] = [
            slots,
            Rate(50, per=60),
            Rate(40_000, per=60, unit="input_tokens", burst=40_000),
            Rate(8_000, per=60, unit="output_tokens", burst=8_000),
        ]
        cost = {"input_tokens": 30_000, "output_tokens": 4_000}
        assert reserve_all(key, 0.0, cost) == 0.0
        # at 1.2 s requests and output tokens have room; 30,000 input tokens come back at 30 s
        assert reserve_all(key, 1.2, cost) == pytest.approx(30.0)
        assert slots.in_use == 1


class TestSharing:
    def test_one_concurrency_object_is_one_budget(self) -> None:
        shared = Concurrency(2)
        agent_a = [Concurrency(10), shared]  # two agents, or two orchestrators' agents
        agent_b = [Concurrency(10), shared]
        assert reserve_all(agent_a, 0.0, 1) == 0.0
        assert reserve_all(agent_b, 0.0, 1) == 0.0
        assert reserve_all(agent_a, 0.0, 1) == math.inf
        assert reserve_all(agent_b, 0.0, 1) == math.inf

    def test_one_rate_object_is_one_budget(self) -> None:
        shared = Rate(60, per=60)
        first = admit_greedily(shared, 30)
        second = admit_greedily(shared, 30)
        assert in_window(sorted(first + second), 0.0, 60.0) == 60


class TestTurns:
    """Room that several askers wait for goes to the best turn among those whose time has come,
    whoever asks first; a waiter that does not come for it in time loses it."""

    def test_the_better_turn_gets_the_refill_whoever_asks_first(self) -> None:
        rate = Rate(1, per=1)
        first, second = Counter(), Counter()
        assert reserve_all([rate], 0.0, 1, first, (0, 0)) == 0.0
        assert reserve_all([rate], 0.0, 1, second, (0, 1)) == 1.0
        assert reserve_all([rate], 0.0, 1, first, (0, 2)) == 1.0
        # At 1.0 the worse turn asks first: it is told to wait for the better one's chance.
        assert reserve_all([rate], 1.0, 1, first, (0, 2)) == 1.0 + LAPSE
        assert reserve_all([rate], 1.0, 1, second, (0, 1)) == 0.0
        assert first.calls == 1, "the better one's reservation tells the next in line"
        assert reserve_all([rate], 1.0, 1, first, (0, 2)) == 2.0

    def test_a_smaller_priority_number_is_a_better_turn(self) -> None:
        rate = Rate(1, per=1)
        low, high = Counter(), Counter()
        rate.reserve(0.0, 1)
        assert reserve_all([rate], 0.0, 1, low, (1, 0)) == 1.0
        assert reserve_all([rate], 0.0, 1, high, (0, 5)) == 1.0
        assert reserve_all([rate], 1.0, 1, low, (1, 0)) == 1.0 + LAPSE
        assert reserve_all([rate], 1.0, 1, high, (0, 5)) == 0.0

    def test_a_waiter_that_does_not_come_loses_its_turn(self) -> None:
        rate = Rate(1, per=1)
        gone, other = Counter(), Counter()
        rate.reserve(0.0, 1)
        reserve_all([rate], 0.0, 1, gone, (0, 0))
        reserve_all([rate], 0.0, 1, other, (0, 1))
        assert reserve_all([rate], 1.0, 1, other, (0, 1)) == 1.0 + LAPSE
        assert reserve_all([rate], 1.0 + LAPSE, 1, other, (0, 1)) == 0.0

    def test_a_better_waiter_whose_time_has_not_come_holds_nobody_back(self) -> None:
        requests = Rate(10, per=1, burst=10)
        tokens = Rate(10, per=1, unit="tokens", burst=10)
        big, small = Counter(), Counter()
        tokens.reserve(0.0, {"tokens": 10})
        # The big one needs 5 tokens: room at 0.5 s. The small one needs none, and goes now.
        assert reserve_all([requests, tokens], 0.0, {"tokens": 5}, big, (0, 0)) == 0.5
        assert reserve_all([requests, tokens], 0.0, {"tokens": 0}, small, (0, 1)) == 0.0
        assert reserve_all([requests, tokens], 0.5, {"tokens": 5}, big, (0, 0)) == 0.0

    def test_a_release_calls_the_best_waiter_alone(self) -> None:
        slots = Concurrency(1)
        first, second = Counter(), Counter()
        assert reserve_all([slots], 0.0, 1) == 0.0
        assert reserve_all([slots], 0.0, 1, second, (0, 1)) == math.inf
        assert reserve_all([slots], 0.0, 1, first, (0, 0)) == math.inf
        slots.release(1, 1.0)
        # Only the best asks again: nobody is refused. The other is reminded, in case it does
        # not come.
        assert (first.calls, second.calls) == (1, 0)
        assert second.reminders == [1.0 + LAPSE]
        assert reserve_all([slots], 1.0, 1, first, (0, 0)) == 0.0
        assert second.calls == 0, "the slot is taken: nobody else is due"
        assert reserve_all([slots], 1.0, 1, second, (0, 1)) == math.inf
        slots.release(1, 2.0)
        assert second.calls == 1
        assert reserve_all([slots], 2.0, 1, second, (0, 1)) == 0.0

    def test_a_waiter_reminded_after_a_release_gets_the_slot_the_best_did_not_take(self) -> None:
        slots = Concurrency(1)
        gone, other = Counter(), Counter()
        slots.reserve(0.0, 1)
        reserve_all([slots], 0.0, 1, gone, (0, 0))
        reserve_all([slots], 0.0, 1, other, (0, 1))
        slots.release(1, 1.0)
        assert other.reminders == [1.0 + LAPSE]
        assert reserve_all([slots], 1.0, 1, other, (0, 1)) == 1.0 + LAPSE
        assert reserve_all([slots], 1.0 + LAPSE, 1, other, (0, 1)) == 0.0

    def test_two_releases_call_the_two_best_waiters(self) -> None:
        slots = Concurrency(2)
        waiters = [Counter() for _ in range(3)]
        slots.reserve(0.0, 1)
        slots.reserve(0.0, 1)
        for i, waiter in enumerate(waiters):
            assert reserve_all([slots], 0.0, 1, waiter, (0, i)) == math.inf
        slots.release(1, 1.0)
        slots.release(1, 1.0)
        assert [w.calls for w in waiters] == [1, 1, 0]

    def test_units_given_back_call_the_best_waiter_and_it_the_next(self) -> None:
        tokens = Rate(10, per=1, unit="tokens", burst=10)
        first, second = Counter(), Counter()
        assert reserve_all([tokens], 0.0, {"tokens": 10}) == 0.0
        assert reserve_all([tokens], 0.0, {"tokens": 5}, second, (0, 1)) == 0.5
        assert reserve_all([tokens], 0.0, {"tokens": 5}, first, (0, 0)) == 0.5
        tokens.reconcile({"tokens": 10}, {"tokens": 0}, 0.1)  # the call cost nothing after all
        assert (first.calls, second.calls) == (1, 0)
        assert reserve_all([tokens], 0.1, {"tokens": 5}, second, (0, 1)) == 0.1 + LAPSE
        assert reserve_all([tokens], 0.1, {"tokens": 5}, first, (0, 0)) == 0.0
        assert second.calls == 1, "the best one's reservation calls the next"
        assert reserve_all([tokens], 0.1, {"tokens": 5}, second, (0, 1)) == 0.0

    def test_a_higher_limit_tells_every_waiter(self) -> None:
        rate = Rate(1, per=10)
        waiter = Counter()
        rate.reserve(0.0, 1)
        assert reserve_all([rate], 0.0, 1, waiter, (0, 0)) == 10.0
        rate.retune(10, 1.0)  # a server's header: the budget is ten times larger
        assert waiter.calls == 1
        assert reserve_all([rate], 1.0, 1, waiter, (0, 0)) == pytest.approx(1.9)

    def test_askers_without_a_turn_neither_wait_in_line_nor_are_held_back(self) -> None:
        rate = Rate(1, per=1)
        waiting = Counter()
        rate.reserve(0.0, 1)
        assert reserve_all([rate], 0.0, 1, waiting, (0, 0)) == 1.0
        assert reserve_all([rate], 1.0, 1) == 0.0  # a planner's call, say
        assert rate.line is not None
        assert len(rate.line) == 1

    def test_a_waiter_whose_dispatcher_is_gone_is_forgotten(self) -> None:
        rate = Rate(1, per=1)
        rate.reserve(0.0, 1)
        reserve_all([rate], 0.0, 1, Counter(), (0, 0))  # nobody keeps the callback
        assert reserve_all([rate], 1.0, 1, Counter(), (0, 1)) == 0.0

    def test_a_line_seen_on_another_clock_is_forgotten(self) -> None:
        rate = Rate(1, per=1)
        waiter = Counter()
        rate.reserve(1000.0, 1)
        reserve_all([rate], 1000.0, 1, waiter, (0, 0))
        assert reserve_all([rate], 5.0, 1, Counter(), (0, 1)) == 0.0


class TestOnAnEventLoop:
    """Dispatchers that sleep until "room at T" and wait on `watch`, in fake time."""

    async def test_two_dispatchers_share_one_slot_with_no_lost_wake_up(
        self, clock: FakeClock
    ) -> None:
        shared = Concurrency(1)
        loop = asyncio.get_running_loop()
        running = peak = 0
        done: list[tuple[str, float]] = []
        start = loop.time()

        async def dispatcher(name: str, jobs: int) -> None:
            nonlocal running, peak
            freed = asyncio.Event()
            for _ in range(jobs):
                while (room := reserve_all([shared], loop.time(), 1, freed.set)) != 0.0:
                    assert room == math.inf
                    await freed.wait()
                    freed.clear()
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(1.0)
                running -= 1
                shared.release(1, loop.time())
                done.append((name, loop.time() - start))

        async with asyncio.timeout(100):
            await asyncio.gather(dispatcher("a", 3), dispatcher("b", 3))
        assert peak == 1
        assert sorted(t for _, t in done) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]

    async def test_sleeping_until_room_at_paces_the_calls(self, clock: FakeClock) -> None:
        rate = Rate(120, per=60)  # one every 0.5 s
        loop = asyncio.get_running_loop()
        sent: list[float] = []

        async def caller() -> None:
            for _ in range(4):
                while room := rate.reserve(loop.time(), 1):
                    await asyncio.sleep(room - loop.time())
                sent.append(loop.time())

        await asyncio.gather(caller(), caller())
        start = sent[0]
        assert [t - start for t in sent] == pytest.approx([0.5 * i for i in range(8)])


class TestPublicNames:
    def test_public_names_say_orchestra(self) -> None:
        assert Concurrency.__module__ == Rate.__module__ == "orchestra"
        assert isinstance(Concurrency(1), Limiter)
        assert isinstance(Rate(1), Limiter)
