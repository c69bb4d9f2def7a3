"""Limits: one protocol for the global limit, per-agent limits and rate limits. Reserve before an
attempt ("go", "room at T" or "room after a release"), reconcile after it, release on every exit;
a 429's Retry-After holds everybody who shares the limiter. Time is handed in, never read."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import ConfigError
from orchestra._limits import (
    LAPSE,
    REQUESTS,
    Concurrency,
    Limiter,
    Rate,
    as_concurrency,
    reserve_all,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from orchestra._limits import Cost
    from orchestra.testing import FakeClock


def admit_greedily(
    limiter: Limiter, count: int, *, start: float = 0.0, cost: Cost = 1
) -> list[float]:
    """One client that wants `count` admissions from `start` on and asks again exactly when told."""
    times: list[float] = []
    now = start
    while len(times) < count:
        room = limiter.reserve(now, cost)
        if room == 0.0:
            times.append(now)
            continue
        assert room > now, "a 'no' must name a later time"
        now = room
    return times


def in_window(times: Sequence[float], start: float, length: float) -> int:
    return sum(1 for t in times if start <= t < start + length)


class Counter:
    """A wake callback that counts its calls (to ask now) and keeps its reminders (to ask at)."""

    def __init__(self) -> None:
        self.calls = 0
        self.reminders: list[float] = []

    def __call__(self, at: float | None = None) -> None:
        if at is None:
            self.calls += 1
        else:
            self.reminders.append(at)


class TestConcurrency:
    def test_reserves_until_full_then_needs_a_release(self) -> None:
        limit = Concurrency(2)
        assert limit.reserve(0.0, 1) == 0.0
        assert limit.reserve(0.0, 1) == 0.0
        assert limit.reserve(0.0, 1) == math.inf
        assert limit.in_use == 2

    def test_release_makes_room(self) -> None:
        limit = Concurrency(1)
        limit.reserve(0.0, 1)
        limit.release(1, 0.5)
        assert limit.reserve(0.5, 1) == 0.0

    def test_counts_attempts_whatever_their_cost(self) -> None:
        limit = Concurrency(2)
        assert limit.reserve(0.0, {"input_tokens": 5000}) == 0.0
        assert limit.reserve(0.0, 7) == 0.0
        assert limit.reserve(0.0, 1) == math.inf

    def test_peek_takes_nothing(self) -> None:
        limit = Concurrency(1)
        assert limit.peek(0.0, 1) == 0.0
        assert limit.in_use == 0
        limit.reserve(0.0, 1)
        assert limit.peek(0.0, 1) == math.inf

    def test_reconcile_keeps_the_slot_until_release(self) -> None:
        limit = Concurrency(1)
        limit.reserve(0.0, 1)
        limit.reconcile(1, 0, 1.0)
        assert limit.in_use == 1
        assert limit.reserve(1.0, 1) == math.inf

    def test_releasing_more_than_reserved_is_a_bug_and_says_so(self) -> None:
        limit = Concurrency(3)
        with pytest.raises(RuntimeError, match="released more"):
            limit.release(1, 0.0)


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


class TestWatch:
    def test_wakes_once_on_the_next_release(self) -> None:
        limit = Concurrency(1)
        wake = Counter()
        limit.reserve(0.0, 1)
        limit.watch(wake)
        limit.release(1, 1.0)
        assert wake.calls == 1
        limit.reserve(1.0, 1)
        limit.release(1, 2.0)
        assert wake.calls == 1, "a watch is for one release"

    def test_the_same_callback_watching_twice_is_woken_once(self) -> None:
        limit = Concurrency(1)
        wake = Counter()
        limit.reserve(0.0, 1)
        limit.watch(wake)
        limit.watch(wake)
        limit.release(1, 1.0)
        assert wake.calls == 1

    def test_every_dispatcher_sharing_the_limit_is_woken(self) -> None:
        shared = Concurrency(1)
        first, second = Counter(), Counter()
        shared.reserve(0.0, 1)
        shared.watch(first)
        shared.watch(second)
        shared.release(1, 1.0)
        assert (first.calls, second.calls) == (1, 1)

    def test_a_failing_callback_does_not_cost_the_others_their_wake_up(self) -> None:
        limit = Concurrency(1)
        woken = Counter()

        def broken() -> None:
            raise LookupError("boom")

        limit.reserve(0.0, 1)
        limit.watch(broken)
        limit.watch(woken)
        with pytest.raises(LookupError):
            limit.release(1, 1.0)
        assert woken.calls == 1
        assert limit.in_use == 0

    def test_a_rate_wakes_its_watchers_when_units_are_given_back(self) -> None:
        rate = Rate(10, per=10, unit="tokens", burst=10)
        wake = Counter()
        rate.reserve(0.0, 10)
        rate.watch(wake)
        rate.reconcile(10, 4, 0.0)
        assert wake.calls == 1


class TestRate:
    def test_no_room_names_the_time_room_comes(self) -> None:
        rate = Rate(2, per=1)
        assert rate.reserve(0.0, 1) == 0.0
        assert rate.reserve(0.0, 1) == 0.5
        assert rate.reserve(0.4, 1) == 0.5
        assert rate.reserve(0.5, 1) == 0.0

    def test_smooths_a_minute_budget_over_the_minute(self) -> None:
        times = admit_greedily(Rate(60, per=60), 200)
        assert in_window(times, 0.0, 1.0) == 1
        assert sum(1 for t in times if t <= 1.0) == 2
        assert in_window(times, 0.0, 60.0) == 60
        assert in_window(times, 60.0, 60.0) == 60

    def test_burst_lets_that_many_through_at_once_then_paces(self) -> None:
        times = admit_greedily(Rate(10, per=1, burst=5), 8)
        assert times[:5] == [0.0] * 5
        assert times[5:] == pytest.approx([0.1, 0.2, 0.3])

    def test_an_idle_spell_refills_only_up_to_the_burst(self) -> None:
        rate = Rate(10, per=1, burst=3)
        admit_greedily(rate, 3)
        times = admit_greedily(rate, 5, start=100.0)
        assert times == pytest.approx([100.0, 100.0, 100.0, 100.1, 100.2])

    def test_a_cost_above_the_burst_goes_when_empty_and_delays_the_next(self) -> None:
        tokens = Rate(1000, per=60, unit="input_tokens")  # 1 token every 60 ms
        assert tokens.reserve(0.0, {"input_tokens": 500}) == 0.0
        assert tokens.reserve(0.0, {"input_tokens": 100}) == pytest.approx(30.0)
        assert tokens.reserve(30.0, {"input_tokens": 100}) == 0.0

    def test_reads_its_own_unit_from_a_mapping(self) -> None:
        out = Rate(100, per=1, unit="output_tokens", burst=100)
        assert out.amount({"input_tokens": 9999, "output_tokens": 40}) == 40
        assert out.amount({"requests": 1}) == 0, "a unit left out counts 0"
        assert out.amount(7) == 7, "a number is in the limiter's own unit"

    def test_every_attempt_is_one_request_unless_the_cost_says_otherwise(self) -> None:
        requests = Rate(1, per=1)
        assert requests.unit == REQUESTS
        assert requests.amount({"input_tokens": 300}) == 1
        assert requests.amount({"requests": 3}) == 3

    def test_giving_back_brings_room_earlier(self) -> None:
        tokens = Rate(100, per=1, unit="tokens")  # 10 ms a token
        tokens.reserve(0.0, 100)  # estimated 100, so the meter is busy until 1.0
        assert tokens.peek(0.2, 1) == pytest.approx(1.0)
        tokens.reconcile(100, 30, 0.2)  # used 30: busy until 0.3
        assert tokens.peek(0.2, 1) == pytest.approx(0.3)

    def test_taking_more_pushes_room_later(self) -> None:
        tokens = Rate(100, per=1, unit="tokens")
        tokens.reserve(0.0, 10)
        tokens.reconcile(10, 60, 0.05)  # 50 more than reserved, charged from now on
        assert tokens.peek(0.05, 1) == pytest.approx(0.6)

    def test_nothing_is_given_back_after_the_meter_drained(self) -> None:
        tokens = Rate(100, per=1, unit="tokens", burst=2)
        tokens.reserve(0.0, 2)
        tokens.reconcile(2, 0, 5.0)  # long after it drained: no credit beyond the burst
        assert admit_greedily(tokens, 3, start=5.0) == pytest.approx([5.0, 5.0, 5.01])

    def test_server_headers_slow_it_to_what_is_left(self) -> None:
        rate = Rate(600, per=60, burst=5)  # 10 a second: 5 at once, then one every 0.1 s
        rate.observe(remaining=3, reset=10.0)  # the server has 3 left for the next 10 s
        times = admit_greedily(rate, 5)
        assert sum(1 for t in times if t < 10.0 - 1e-9) == 3
        assert times == pytest.approx([9.7, 9.8, 9.9, 10.0, 10.1])

    def test_nothing_left_means_room_at_the_reset(self) -> None:
        rate = Rate(60, per=60)
        rate.observe(remaining=0, reset=42.0)
        assert rate.reserve(0.0, 1) == pytest.approx(42.0)

    def test_headers_never_speed_it_up(self) -> None:
        rate = Rate(1, per=10)
        rate.reserve(0.0, 1)
        rate.observe(remaining=1000, reset=1.0)
        rate.observe(remaining=math.nan, reset=1.0)
        assert rate.reserve(0.0, 1) == 10.0

    def test_release_gives_nothing_back(self) -> None:
        rate = Rate(1, per=10)
        rate.reserve(0.0, 1)
        rate.release(1, 0.0)
        assert rate.reserve(0.0, 1) == 10.0

    def test_never_needs_a_release(self) -> None:
        rate = Rate(1, per=3600)
        rate.reserve(0.0, 1)
        assert math.isfinite(rate.reserve(0.0, 1))


class TestRetune:
    def test_a_higher_limit_drains_what_was_admitted_faster(self) -> None:
        rate = Rate(1, per=1.0)
        assert rate.reserve(0.0, 1) == 0.0  # the next room is at 1.0 on the old pace
        assert rate.peek(0.0, 1) == pytest.approx(1.0)
        rate.retune(10, now=0.0)
        assert rate.limit == 10
        assert rate.interval == pytest.approx(0.1)
        assert rate.peek(0.0, 1) == pytest.approx(0.1)

    def test_a_lower_limit_slows_the_meter_from_now(self) -> None:
        rate = Rate(10, per=1.0)
        assert rate.reserve(0.0, 1) == 0.0
        rate.retune(1, now=0.05)
        # 0.05 s of the 0.1 s reservation was left: it now takes ten times as long
        assert rate.peek(0.05, 1) == pytest.approx(0.55)

    def test_an_idle_meter_keeps_no_debt(self) -> None:
        rate = Rate(10, per=1.0)
        rate.retune(2, now=5.0)
        assert rate.reserve(5.0, 1) == 0.0

    def test_a_bad_limit_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError):
            Rate(1).retune(0, now=0.0)


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

    def test_as_concurrency_shares_an_object_and_wraps_an_int(self) -> None:
        shared = Concurrency(3)
        assert as_concurrency(shared, "concurrency") is shared
        own = as_concurrency(3, "concurrency")
        assert own is not as_concurrency(3, "concurrency")
        assert own.limit == 3


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


class TestValidation:
    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", math.nan, None])
    def test_concurrency_limit(self, bad: object) -> None:
        with pytest.raises(ConfigError, match="Concurrency limit"):
            Concurrency(bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize("field", ["limit", "per", "burst"])
    @pytest.mark.parametrize("bad", [0, -2, math.nan, math.inf, True, "5", None])
    def test_rate_numbers(self, field: str, bad: object) -> None:
        args: dict[str, object] = {"limit": 10, "per": 1.0, "burst": 1}
        args[field] = bad
        with pytest.raises(ConfigError, match=f"Rate {field} must be a finite number > 0"):
            Rate(**args)  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", ["", 3, None])
    def test_rate_unit(self, bad: object) -> None:
        with pytest.raises(ConfigError, match="Rate unit"):
            Rate(1, unit=bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", [0, -1, 2.0, False, "8"])
    def test_as_concurrency_names_the_field(self, bad: object) -> None:
        with pytest.raises(ConfigError, match=r"agent 'writer': concurrency must be"):
            as_concurrency(bad, "agent 'writer': concurrency")  # type: ignore[arg-type]

    def test_fractional_rates_are_fine(self) -> None:
        rate = Rate(0.5, per=1.0)  # one every two seconds
        assert admit_greedily(rate, 3) == [0.0, 2.0, 4.0]


class TestReporting:
    def test_concurrency_snapshot_and_repr(self) -> None:
        limit = Concurrency(2)
        limit.reserve(0.0, 1)
        limit.reserve(0.0, 1)
        limit.watch(Counter())
        assert limit.snapshot(1.0) == {
            "type": "concurrency",
            "limit": 2,
            "in_use": 2,
            "room_at": math.inf,
            "held_until": None,
            "watchers": 1,
        }
        assert repr(limit) == "Concurrency(limit=2, in_use=2)"

    def test_rate_snapshot_and_repr(self) -> None:
        rate = Rate(60, per=60, unit="requests", burst=2)
        rate.reserve(10.0, 1)
        rate.reserve(10.0, 1)
        rate.hold_until(30.0)
        snap = rate.snapshot(10.5)
        assert snap["in_use"] == pytest.approx(1.5)
        assert snap["room_at"] == 30.0
        assert snap["held_until"] == 30.0
        assert repr(rate) == "Rate(60, per=60, unit='requests', burst=2)"

    def test_public_names_say_orchestra(self) -> None:
        assert Concurrency.__module__ == Rate.__module__ == "orchestra"
        assert isinstance(Concurrency(1), Limiter)
        assert isinstance(Rate(1), Limiter)


# --- properties -------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release", "reconcile", "hold"]), st.floats(0, 5)),
    max_size=200,
)


@given(limit=st.integers(1, 8), steps=ops)
def test_concurrency_never_exceeds_its_limit(limit: int, steps: list[tuple[str, float]]) -> None:
    limiter = Concurrency(limit)
    held = 0
    now = 0.0
    for op, dt in steps:
        now += dt
        if op == "reserve":
            room = limiter.reserve(now, 1)
            if room == 0.0:
                held += 1
            else:
                assert room > now
        elif op == "release" and held:
            limiter.release(1, now)
            held -= 1
        elif op == "reconcile" and held:
            limiter.reconcile(1, dt, now)
        elif op == "hold":
            limiter.hold_until(now + dt)
        assert limiter.in_use == held <= limit


@settings(max_examples=300)
@given(
    limit=st.integers(1, 50),
    per=st.sampled_from([0.5, 1.0, 7.0, 60.0]),
    burst=st.integers(1, 10),
    requests=st.lists(
        st.tuples(st.floats(0, 30), st.integers(1, 10), st.floats(0, 1)), min_size=1, max_size=80
    ),
)
def test_a_rate_admits_at_most_limit_plus_burst_in_any_window(
    limit: int, per: float, burst: int, requests: list[tuple[float, int, float]]
) -> None:
    """Clients arrive at random times with costs up to the burst, ask again exactly when told, and
    give back a random share of what they reserved: no window of `per` seconds ever sees more than
    `limit + burst` of the units they kept, and "room at T" is never a lie."""
    rate = Rate(limit, per=per, unit="tokens", burst=burst)
    kept: list[tuple[float, float]] = []
    now = 0.0
    for gap, asked, share in requests:
        cost = min(asked, burst)
        now += gap
        room = rate.reserve(now, cost)
        if room:
            assert room > now
            now = room
            assert rate.reserve(now, cost) == 0.0, "room at T must be room at T"
        used = math.floor(cost * share)
        rate.reconcile(cost, used, now)
        kept.append((now, used))
    window = per * (1 - 1e-9)
    for start, _ in kept:
        total = sum(units for t, units in kept if start <= t <= start + window)
        assert total <= limit + burst
