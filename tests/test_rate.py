"""Rate: at most N units per period, spread evenly (a GCRA): "room at T" when there is none, its own
unit read from a cost, units given back or taken after the call, slowed by a server's headers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra import ConfigError
from orchestra._limits import REQUESTS
from orchestra._rate import Rate
from tests.limit_helpers import Counter, admit_greedily, in_window


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


class TestWatch:
    def test_a_rate_wakes_its_watchers_when_units_are_given_back(self) -> None:
        rate = Rate(10, per=10, unit="tokens", burst=10)
        wake = Counter()
        rate.reserve(0.0, 10)
        rate.watch(wake)
        rate.reconcile(10, 4, 0.0)
        assert wake.calls == 1


class TestValidation:
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

    def test_fractional_rates_are_fine(self) -> None:
        rate = Rate(0.5, per=1.0)  # one every two seconds
        assert admit_greedily(rate, 3) == [0.0, 2.0, 4.0]


class TestReporting:
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


# --- properties -------------------------------------------------------------------------------


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
