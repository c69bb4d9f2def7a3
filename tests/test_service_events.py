"""A run's events as Server-Sent Events, through a real uvicorn server (the in-process ASGI
transport buffers a stream): every journal event once, in order, and `Last-Event-ID` resumes
after the event it names. Then the cursor alone, under writers that commit out of order."""

from __future__ import annotations

import json
import random
import time
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from orchestra._service._events import Cursor, key_of
from orchestra.stores import SQLiteStore
from tests.service_kit import Api, server, serving

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    store = SQLiteStore(tmp_path / "events.db")
    try:
        async with serving(store, concurrency=1) as api:
            yield api
    finally:
        store.close()


async def _read(
    url: str, headers: dict[str, str], *, on_first: Any = None
) -> list[tuple[str | None, str | None, Any]]:
    """The stream's events, (event name, id, data), until its `end`."""
    got: list[tuple[str | None, str | None, Any]] = []
    name = event_id = data = None
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("GET", url, headers=headers) as answer,
    ):
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        async for line in answer.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and data is not None:
                got.append((name, event_id, data))
                if on_first is not None and len(got) == 1:
                    on_first()
                if name == "end":
                    return got
                name = event_id = data = None
    raise AssertionError(f"the stream ended without its end event: {got}")


def _identity(event: dict[str, Any]) -> tuple[Any, ...]:
    return (event["task_id"], event["event"], event["attempt"], event["seq"], event["at"])


class TestTheStream:
    async def test_delivers_every_journal_event_once_in_order_then_ends(self, api: Api) -> None:
        body = {"tasks": [{"kind": "wait", "id": "a"}, {"kind": "echo", "id": "b"},
                          {"kind": "fail", "id": "c"}]}  # fmt: skip
        run_id = await api.submit(body)
        async with server(api.app) as url:
            got = await _read(
                f"{url}/api/runs/{run_id}/events", api.auth("read"), on_first=api.gate.set
            )
        *events, end = got
        assert end[0] == "end"
        assert end[2] == {"run_id": run_id, "state": "closed", "status": "failed"}
        journal = await anyio.to_thread.run_sync(api.service.store.events, run_id)
        delivered = [data for _, _, data in events]
        assert sorted(map(_identity, delivered)) == sorted(map(_identity, journal))
        keys = [key_of(e) for e in delivered]
        assert keys == sorted(keys)  # in the journal's order
        ids = [event_id for _, event_id, _ in events]
        assert all(ids), "every event has an id"
        assert ("b", "succeeded") in {(e["task_id"], e["event"]) for e in delivered}

    async def test_last_event_id_resumes_after_the_event_it_names(self, api: Api) -> None:
        run_id = await api.submit({"tasks": [{"kind": "echo", "id": x} for x in "abcd"]})
        await api.handle(run_id)
        async with server(api.app) as url:
            everything = await _read(f"{url}/api/runs/{run_id}/events", api.auth("read"))
            events = everything[:-1]
            for k in (0, 3, len(events) - 1):
                rest = await _read(
                    f"{url}/api/runs/{run_id}/events",
                    {**api.auth("read"), "Last-Event-ID": str(events[k][1])},
                )
                assert [d for _, _, d in rest[:-1]] == [d for _, _, d in events[k + 1 :]], k
                assert rest[-1][0] == "end"

    async def test_the_store_reads_the_journal_from_a_time_on(self, api: Api) -> None:
        run_id = await api.submit({"tasks": [{"kind": "echo", "id": x} for x in "abcdef"]})
        await api.handle(run_id)
        store = api.service.store
        journal = await anyio.to_thread.run_sync(store.events, run_id)
        mid = journal[len(journal) // 2]["at"]
        later = await anyio.to_thread.run_sync(lambda: store.events(run_id, since=mid))
        assert later == [e for e in journal if e["at"] >= mid]
        assert 0 < len(later) < len(journal)

    async def test_the_store_reads_a_run_s_record_without_counting_its_tasks_when_asked(
        self, api: Api
    ) -> None:
        """What a stream asks each poll of a run no process here runs (whose is it, is it
        over): the run's row, not a count of its tasks by state (a scan of every row)."""
        run_id = await api.submit({"tasks": [{"kind": "echo", "id": x} for x in "abc"]})
        await api.handle(run_id)
        store = api.service.store
        whole = await anyio.to_thread.run_sync(store.run_info, run_id)
        bare = await anyio.to_thread.run_sync(lambda: store.run_info(run_id, counts=False))
        assert whole["counts"] == {"succeeded": 3}
        assert bare == {k: v for k, v in whole.items() if k != "counts"}
        asked: list[bool] = []
        run_info = store.run_info

        def spy(run_id: str, *, counts: bool = True) -> Any:
            asked.append(counts)
            return run_info(run_id, counts=counts)

        store.run_info = spy
        async with server(api.app) as url:
            told = await _read(f"{url}/api/runs/{run_id}/events", api.auth("read"))
        assert told[-1][0] == "end"
        assert asked.count(True) == 1  # the route's check that the run exists, once
        assert asked.count(False) >= 1  # each poll's question

    async def test_a_slow_journal_is_read_less_often(self, api: Api) -> None:
        """A read of the journal that takes 0.2 s is followed by a wait of a second (reads take
        at most a fifth of the stream's time), not by the poll's tenth of a second."""
        run_id = await api.submit({"tasks": [{"kind": "wait", "id": "w"}]})
        store = api.service.store
        events = store.events
        reads: list[float] = []

        def slow(run_id: str, task_id: str | None = None, *, since: float | None = None) -> Any:
            reads.append(time.monotonic())
            time.sleep(0.2)
            return events(run_id, task_id, since=since)

        store.events = slow
        async with server(api.app) as url:
            with anyio.move_on_after(3):
                await _read(f"{url}/api/runs/{run_id}/events", api.auth("read"))
        store.events = events
        api.gate.set()
        await api.handle(run_id)
        # Read at the poll's pace (0.3 s a round) 3 s would hold 10 reads; at a fifth, 3.
        assert 2 <= len(reads) <= 4, reads

    async def test_a_silent_stream_sends_keep_alive_comments(
        self, api: Api, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from orchestra._service import _events

        monkeypatch.setattr(_events, "KEEPALIVE", 0.3)
        run_id = await api.submit({"tasks": [{"kind": "wait", "id": "a"}]})
        lines: list[str] = []
        async with (
            server(api.app) as url,
            httpx.AsyncClient(timeout=30) as client,
            client.stream("GET", f"{url}/api/runs/{run_id}/events", headers=api.auth()) as s,
        ):
            with anyio.fail_after(10):
                async for line in s.aiter_lines():
                    lines.append(line)
                    if line == ": ping":
                        break
            api.gate.set()
        assert any(line.startswith("data: ") for line in lines)  # a's admission came first

    async def test_an_unknown_run_is_a_404_before_any_stream(self, api: Api) -> None:
        async with server(api.app) as url, httpx.AsyncClient() as client:
            answer = await client.get(f"{url}/api/runs/ghost/events", headers=api.auth("read"))
        assert answer.status_code == 404
        assert answer.json()["error"] == "not_found"


def _event(at: float, task: str, name: str, seq: int | None = None) -> dict[str, Any]:
    return {"seq": seq, "run_id": "r", "task_id": task, "at": at, "event": name,
            "agent": None, "attempt": None, "detail": None}  # fmt: skip


class TestTheCursor:
    def test_holds_back_what_is_younger_than_the_settle_window(self) -> None:
        cursor = Cursor(None, settle=1.0)
        journal = [_event(10.0, "a", "admitted"), _event(10.5, "b", "admitted")]
        assert [e["task_id"] for e, _ in cursor.take(journal, 11.2, final=False)] == ["a"]
        assert [e["task_id"] for e, _ in cursor.take(journal, 11.6, final=False)] == ["b"]
        assert cursor.take(journal, 20.0, final=False) == []

    def test_with_the_stores_horizon_delivers_what_is_dated_before_it_whatever_the_time(
        self,
    ) -> None:
        cursor = Cursor(None, settle=1.0)
        journal = [_event(10.0, "a", "admitted"), _event(10.5, "b", "admitted")]
        # At the horizon itself a transaction that started then may still write: held back.
        taken = cursor.take(journal, 10.6, final=False, horizon=10.5)
        assert [e["task_id"] for e, _ in taken] == ["a"]
        taken = cursor.take(journal, 10.6, final=False, horizon=10.50001)
        assert [e["task_id"] for e, _ in taken] == ["b"]

    def test_reads_from_itself_on_but_late_ones_from_the_late_window_and_when_resumed(
        self,
    ) -> None:
        cursor = Cursor(None, settle=1.0, late=60.0)
        assert cursor.since(late=False) is None  # nothing delivered: from the start
        cursor.take([_event(100.0, "a", "admitted")], 200.0, final=False)
        assert (cursor.since(late=False), cursor.since()) == (100.0, 40.0)
        resumed = Cursor(key_of(_event(100.0, "a", "admitted")), settle=1.0, late=60.0)
        assert resumed.since(late=False) == 40.0  # what its client saw is read again, first

    def test_delivers_everything_left_once_the_run_is_over(self) -> None:
        cursor = Cursor(None, settle=1.0)
        journal = [_event(10.0, "a", "admitted"), _event(10.9, "a", "succeeded")]
        assert len(cursor.take(journal, 10.95, final=True)) == 2

    def test_a_late_event_is_delivered_once_and_keeps_the_id_growing(self) -> None:
        cursor = Cursor(None, settle=1.0)
        first = [_event(10.0, "a", "admitted"), _event(12.0, "b", "admitted")]
        delivered = cursor.take(first, 14.0, final=False)
        late = _event(11.0, "c", "admitted")  # committed after b, stamped before it
        again = cursor.take([*first, late], 14.1, final=False)
        assert [e["task_id"] for e, _ in again] == ["c"]
        assert again[0][1] == delivered[-1][1]  # the cursor did not move back
        assert cursor.take([*first, late], 14.2, final=False) == []

    def test_a_resumed_cursor_skips_what_its_client_saw(self) -> None:
        journal = [_event(10.0 + i, t, "admitted") for i, t in enumerate("abcd")]
        first = Cursor(None, settle=1.0).take(journal, 100.0, final=False)
        seen_id = first[1][1]
        from orchestra._service._events import decode

        resumed = Cursor(decode(seen_id), settle=1.0)
        assert [e["task_id"] for e, _ in resumed.take(journal, 100.0, final=False)] == ["c", "d"]

    @pytest.mark.parametrize("seed", range(3))
    @pytest.mark.parametrize("lag", [0.4, 3.0])
    def test_concurrent_writers_committing_out_of_order_lose_and_repeat_nothing(
        self, seed: int, lag: float
    ) -> None:
        """Several writers stamp events with their transaction's start and commit up to `lag`
        later, in any order (within the settle window, and past it); a reader polls now and then.
        Every event is delivered exactly once and the ids it sends never go back."""
        rng = random.Random(seed)
        settle = 1.0
        events = []
        for n in range(400):
            at = rng.uniform(0, 50)
            events.append((at + rng.uniform(0, lag), _event(at, f"t{n}", "admitted", seq=n)))
        cursor = Cursor(None, settle=settle)
        delivered: list[dict[str, Any]] = []
        ids: list[str] = []
        now = 0.0
        while now < 60:
            now += rng.uniform(0.05, 0.5)
            visible = [e for committed, e in events if committed <= now]
            for event, event_id in cursor.take(visible, now, final=False):
                delivered.append(event)
                ids.append(event_id)
        for event, event_id in cursor.take([e for _, e in events], now, final=True):
            delivered.append(event)
            ids.append(event_id)
        assert sorted(e["seq"] for e in delivered) == list(range(400))
        from orchestra._service._events import decode

        positions = [decode(i) for i in ids]
        assert positions == sorted(positions)


class TestTheEnd:
    async def test_a_stopped_run_ends_its_stream_and_its_resumption_streams_on_after_it(
        self, api: Api
    ) -> None:
        body: dict[str, Any] = {"tasks": [{"kind": "echo", "id": "a"}, {"kind": "wait", "id": "b"}]}
        run_id = await api.submit(body)
        events = f"/api/runs/{run_id}/events"
        async with server(api.app) as url:
            got: list[tuple[str | None, str | None, Any]] = []

            async def read() -> None:
                got.extend(await _read(f"{url}{events}", api.auth("read")))

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                with anyio.fail_after(10):
                    while "b" not in api.calls:
                        await anyio.sleep(0.01)
                answer = await api.client.post(
                    f"/api/runs/{run_id}/stop", json={"grace": 0}, headers=api.auth("control")
                )
                assert answer.status_code == 200
                with anyio.fail_after(10):  # the stream ends: nobody runs the run any more
                    while not got:
                        await anyio.sleep(0.01)
            *first, end = got
            assert end[0] == "end"
            assert end[2] == {"run_id": run_id, "state": "stopped", "status": "cancelled"}
            record = await api.client.get(f"/api/runs/{run_id}", headers=api.auth("read"))
            assert record.json()["state"] == "open"  # resumable

            api.gate.set()
            assert await api.submit({**body, "run_id": run_id}) == run_id  # resumed
            await api.handle(run_id)
            rest = await _read(
                f"{url}{events}", {**api.auth("read"), "Last-Event-ID": str(first[-1][1])}
            )
        *second, end = rest
        assert end[2] == {"run_id": run_id, "state": "closed", "status": "success"}
        told = [key_of(d) for _, _, d in first] + [key_of(d) for _, _, d in second]
        assert len(told) == len(set(told))  # nothing twice
        journal = await anyio.to_thread.run_sync(api.service.store.events, run_id)
        assert {key_of(e) for e in journal} <= set(told)  # nothing missed
        assert ("b", "succeeded") in {(d["task_id"], d["event"]) for _, _, d in second}


class TestTheHorizonOnSQLite:
    async def test_what_is_dated_before_it_is_in_the_file_and_an_idle_run_is_told_at_once(
        self, api: Api
    ) -> None:
        """The service's own run tells where its writer stands: every event dated before the
        horizon is in the file when the horizon is asked (sampled while the run goes, each
        sample against the whole journal afterwards); once the run waits with nothing left to
        write, the horizon is now, past every event (no settle window)."""
        store = api.service.store
        tasks = [{"kind": "echo", "id": f"e{n}"} for n in range(2000)]
        run_id = await api.submit({"tasks": [*tasks, {"kind": "wait", "id": "w"}]})
        run = store.open_runs[run_id]
        samples: list[tuple[float, float, set[Any]]] = []
        with anyio.fail_after(30):
            while True:
                horizon, now = run.horizon(), time.time()
                journal = await anyio.to_thread.run_sync(store.events, run_id)
                keys = {key_of(e) for e in journal}
                samples.append((horizon, now, keys))
                if ("w", "started") in {(k[5], k[4]) for k in keys} and horizon > max(keys)[0]:
                    break  # the run waits for w: its last window is written, and nothing since
        api.gate.set()
        await api.handle(run_id)
        journal = [key_of(e) for e in await anyio.to_thread.run_sync(store.events, run_id)]
        for horizon, _, seen in samples:
            assert {k for k in journal if k[0] < horizon} <= seen
        # While the run went, the horizon held back what was happening and not written yet.
        assert any(any(h <= k[0] < now for k in journal) for h, now, _ in samples)
