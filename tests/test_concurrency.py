"""Concurrency: at most N attempts at once, whatever their cost; a release makes room and wakes
whoever watched for it. An int or a shared object, as the orchestrator and agents take it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestra import ConfigError
from orchestra._concurrency import Concurrency, as_concurrency
from tests.limit_helpers import Counter


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


class TestAsConcurrency:
    def test_as_concurrency_shares_an_object_and_wraps_an_int(self) -> None:
        shared = Concurrency(3)
        assert as_concurrency(shared, "concurrency") is shared
        own = as_concurrency(3, "concurrency")
        assert own is not as_concurrency(3, "concurrency")
        assert own.limit == 3

    @pytest.mark.parametrize("bad", [0, -1, 2.0, False, "8"])
    def test_as_concurrency_names_the_field(self, bad: object) -> None:
        with pytest.raises(ConfigError, match=r"agent 'writer': concurrency must be"):
            as_concurrency(bad, "agent 'writer': concurrency")  # type: ignore[arg-type]


class TestValidation:
    @pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", math.nan, None])
    def test_concurrency_limit(self, bad: object) -> None:
        with pytest.raises(ConfigError, match="Concurrency limit"):
            Concurrency(bad)  # type: ignore[arg-type]


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
