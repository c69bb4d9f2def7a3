"""The run's report: successes counted in batches give the counts that one at a time gives."""

from __future__ import annotations

from orchestra import Task
from orchestra._core._report import Report
from orchestra._record import Record
from orchestra._task import FAILED, SUCCEEDED


def ended(
    i: int, kind: str, status: str, started: float, finished: float, agent: str = "a"
) -> Record:
    record = Record(Task(kind), i, None)
    record.status = status  # type: ignore[assignment]
    record.agent = agent if status is SUCCEEDED else None
    record.started = started
    record.finished = finished
    record.error = "boom"
    record.error_type = "ValueError"
    record.defaulted = False  # (as every store's end of a task sets it)
    return record


def tallies(report: Report) -> dict[str, tuple[object, ...]]:
    return {
        name: (
            k.admitted, k.succeeded, k.failed, k.timed, round(k.busy, 9), k.longest,
            k.sample.count, list(k.sample.sample),
        )
        for name, k in report.kinds.items()
    }  # fmt: skip


def one_by_one(records: list[Record], kinds: list[str]) -> Report:
    """The reference: every record counted alone, as before batching."""
    report = Report()
    for kind in kinds:
        report.admitted_one(kind)
    for record in records:
        report._one(record)
    return report


def batched(records: list[Record], kinds: list[str]) -> Report:
    report = Report()
    for kind in kinds:
        report.admitted_one(kind)
    for record in records:
        report.finished(record)
    return report


class TestBatchedSuccesses:
    def test_one_kind_in_one_second_counts_as_one_at_a_time(self) -> None:
        records = [
            ended(i, "k", SUCCEEDED, i * 1e-5, i * 1e-5 + (i % 7) * 1e-6) for i in range(5000)
        ]
        records[3000] = ended(3000, "k", FAILED, 0.03, 0.031)
        expected, got = one_by_one(records, ["k"]), batched(records, ["k"])
        assert tallies(got) == tallies(expected)
        assert got.per_agent == expected.per_agent == {"a": 4999}
        assert got.window(0.5, 10) == expected.window(0.5, 10)
        assert [r.id for r in got.not_ok] == [records[3000].id]

    def test_a_success_by_default_counts_in_its_place_and_is_listed(self) -> None:
        records = [ended(i, "k", SUCCEEDED, i * 1e-5, i * 1e-5 + 1e-6) for i in range(600)]
        for i in (7, 300, 599):
            records[i].defaulted = True
        expected, got = one_by_one(records, ["k"]), batched(records, ["k"])
        assert tallies(got) == tallies(expected)
        assert got.defaulted == expected.defaulted == [records[i].id for i in (7, 300, 599)]

    def test_kinds_agents_and_seconds_mixed_count_as_one_at_a_time(self) -> None:
        records = [
            ended(i, f"k{i % 3}", SUCCEEDED, i * 1e-3, i * 1e-3 + 0.01, agent=f"a{i % 2}")
            for i in range(4000)
        ]
        expected, got = (
            one_by_one(records, ["k0", "k1", "k2"]),
            batched(records, ["k0", "k1", "k2"]),
        )
        assert tallies(got) == tallies(expected)
        assert got.per_agent == expected.per_agent
        assert got.window(4.0, 5) == expected.window(4.0, 5)

    def test_many_kinds_in_one_second_count_as_one_at_a_time(self) -> None:
        records = [
            ended(i, f"k{i % 5}", SUCCEEDED, i * 1e-4, i * 1e-4 + (i % 11) * 1e-5, f"a{i % 3}")
            for i in range(3000)
        ]
        records[1234] = ended(1234, "k4", FAILED, 0.12, 0.13)
        records[2000] = ended(2000, "late", SUCCEEDED, 0.2, 0.25)  # a kind never admitted
        kinds = [f"k{j}" for j in range(5)]
        expected, got = one_by_one(records, kinds), batched(records, kinds)
        assert tallies(got) == tallies(expected)
        assert got.per_agent == expected.per_agent
        assert got.window(0.9, 1) == expected.window(0.9, 1)
        assert got.ended == expected.ended == 3000

    def test_a_whole_run_counted_at_its_end_counts_as_one_at_a_time(self) -> None:
        # A whole-list run puts every success aside and counts them when something reads the
        # counts: one batch spanning many seconds, split at each second.
        records = [
            ended(i, f"k{i % 2}", SUCCEEDED, i * 2e-3, i * 2e-3 + (i % 5) * 1e-3, f"a{i % 3}")
            for i in range(6000)
        ]
        kinds = ["k0", "k1"]
        expected = one_by_one(records, kinds)
        got = Report()
        for kind in kinds:
            got.admitted_one(kind)
        got.batch.extend(records)
        assert tallies(got) == tallies(expected)
        assert got.per_agent == expected.per_agent
        assert got.window(12.5, 10) == expected.window(12.5, 10)
        assert got.ended == expected.ended

    def test_a_reader_sees_every_success_before_a_batch_is_full(self) -> None:
        report = Report()
        report.admitted_one("k")
        for i in range(10):
            report.finished(ended(i, "k", SUCCEEDED, 0.0, 0.5))
        assert report.kinds["k"].succeeded == 10
        assert report.window(0.9, 1) == (10, 0, 0.9)
        report.finished(ended(10, "k", SUCCEEDED, 0.0, 0.6))
        assert report.kinds["k"].succeeded == 11
        assert report.per_agent == {"a": 11}


class TestAdmitted:
    def test_a_batch_is_counted_by_kind_whether_it_has_one_kind_or_several(self) -> None:
        report = Report()
        report.admitted([Task("a"), Task("b"), Task("a")])
        report.admitted([Task("c"), Task("c")])
        report.admitted([])
        assert {name: k.admitted for name, k in report.kinds.items()} == {"a": 2, "b": 1, "c": 2}
