"""Durations in bounded memory: exact figures, and a uniform, reproducible sample for percentiles."""

from __future__ import annotations

import pytest

from orchestra._core._durations import Durations


class TestDurations:
    def test_exact_up_to_the_sample_then_bounded(self) -> None:
        durations = Durations()
        values = [float(i % 1000) for i in range(20_000)]
        for v in values:
            durations.add(v)
        assert durations.count == 20_000
        assert len(durations.sample) == Durations.SAMPLE
        assert durations.total / durations.count == pytest.approx(sum(values) / len(values))
        assert durations.max == 999.0
        ordered = sorted(durations.sample)
        assert ordered[int(0.95 * len(ordered))] == pytest.approx(950, abs=25)

    def test_all_at_once_is_a_uniform_reproducible_sample(self) -> None:
        values = [float(i) for i in range(30_000)]
        first, second = Durations(), Durations()
        first.extend(values)
        second.extend(values)
        assert first.sample == second.sample  # seeded: a run's report is reproducible
        assert len(set(first.sample)) == Durations.SAMPLE
        assert set(first.sample) <= set(values)
        assert (first.count, first.total, first.max) == (30_000, sum(values), 29_999.0)
        ordered = sorted(first.sample)
        assert ordered[len(ordered) // 2] == pytest.approx(15_000, abs=700)
        assert ordered[int(0.95 * len(ordered))] == pytest.approx(28_500, abs=700)
        # What comes after keeps the sample uniform over everything seen.
        for v in range(30_000):
            first.add(100_000.0 + v)
        later = sum(1 for v in first.sample if v >= 100_000) / Durations.SAMPLE
        assert later == pytest.approx(0.5, abs=0.05)

    @pytest.mark.parametrize("split", [10, 4096, 5000])
    def test_adding_many_at_once_keeps_the_same_sample(self, split: int) -> None:
        values = [float(i) for i in range(30_000)]
        one_by_one, at_once = Durations(), Durations()
        for v in values:
            one_by_one.add(v)
        for v in values[:split]:
            at_once.add(v)
        at_once.extend(values[split:])
        assert at_once.sample == one_by_one.sample
        assert (at_once.count, at_once.total, at_once.max) == (30_000, sum(values), 29_999.0)

    def test_small_runs_keep_every_duration(self) -> None:
        durations = Durations()
        for v in (3.0, 1.0, 2.0):
            durations.add(v)
        assert sorted(durations.sample) == [1.0, 2.0, 3.0]
