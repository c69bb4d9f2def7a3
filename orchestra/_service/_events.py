"""A run's live events as Server-Sent Events that tail the store's journal
(``GET /api/runs/{run_id}/events``), so that a client of any process serving the store sees every
event, whoever wrote it.

**The cursor.** Neither store numbers every event: the journal is partly rows of its ``events``
table (with a ``seq``) and partly read from the rows of tasks and attempts (a task's admission, a
first start, its end: `SQLiteStore.events`, `PostgresStore.events`). So the stream orders events
by their place in the journal, the key (time, rank, seq, attempt, event, task), and its cursor is
the key of the last event delivered, sent as each event's SSE ``id``; ``Last-Event-ID`` resumes
after it.

A key is not a commit order: SQLite writes a run's changes once a window (an event is stamped
when it happened and written up to a window later), and PostgreSQL stamps a row with its
transaction's start (`now()`), so a transaction that commits later may carry an earlier time.
Hence the *horizon*: the stream delivers, in key order, only the events dated before a time no
event still to commit can precede, so that the keys it sends only grow and a resumed stream misses
nothing.

- **PostgreSQL**: the start of the oldest transaction running on the database in one of
  orchestra's own sessions (`stores._postgres._admin.horizon`: every orchestra connection is named
  ``orchestra host:pid``, over any ``application_name`` the DSN gives; another application's or a
  psql session's transaction writes no journal and holds nobody back). One of ours open longer
  than `BOUND` seconds (its process stopped mid-transaction) is not waited for: the settle rule
  meanwhile, and what it commits comes late. So does the settle rule where the database hides
  the state of one of our sessions (another role, without `pg_read_all_stats`).
- **SQLite**: ``orchestra serve`` is the file's one service (a lock), and the runs it runs are
  stamped and written by its own writer, which says the start of the oldest window it has not
  committed, or now when nothing is pending (`SQLiteRun.horizon`). What this process cannot see
  into has the *settle* window instead, `settle` seconds (1 s) behind now: a run another process
  runs on the file, and a run worker processes may serve (``orchestra worker --db``: they stamp
  their tasks' ends by their own clocks and commit them when they can).

An event that still arrives behind the cursor (one dated by a process's clock, not the database's;
one a transaction past the bound commits; on SQLite, a window written later than `settle`) is
delivered all the same, once (the identities delivered over the last `late` seconds are kept to
tell), with the cursor unchanged as its id.

**Starts on PostgreSQL.** No journal row says a task started until it ended (its row says it
then, dated by the claiming process's clock): a row at the claim would cost the workers a write per
task. So each poll reads the run's leased tasks with the horizon (`_admin.watch`, from the index
of leased rows) and tells the start of each not told yet, dated at that horizon (before its end,
after what was told); the start the ended task's row says is then not told again. A client that
reconnects while a task runs is told its start again (the stream does not know what a stream
before it told live); its `task_id` and `attempt` name it.

**The end.** Once nobody runs the run, here or elsewhere, and it is closed, or it was let go of
open (stopped gracefully: resumable), everything left is delivered and the stream ends with an
``end`` event: ``{"run_id", "state": "closed" | "stopped", "status"}`` (the `RunResult`'s status
when this process ran it, else null). A run whose process died is still held (its lease lapsed,
not let go): its stream goes on while another process takes it over. A stopped run resumed later
is a new stream (``Last-Event-ID`` resumes after what the last one sent).

A poll reads the journal from the cursor on (`store.events(..., since=...)`): what comes in
order. Every `SWEEP` seconds (and first) it reads from `late` seconds behind the cursor instead,
for what comes late: reading and sorting that window each poll cost a busy run's stream more than
the latency it is for (30,000 events, 0.3 s a poll), and a late event is late anyway. The
database still reads the run's rows to build its journal (most of it is read from the rows of
tasks).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any, Final

import anyio
from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse
from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event

from ..stores import SQLiteStore
from ._auth import require
from ._errors import Refused, responses
from ._runs import KnownRun, RunPath, ServiceDep
from ._state import holder

__all__ = ("Cursor", "key_of", "router")

SETTLE: Final = 1.0
"""Seconds an event's time must lie behind now before it is delivered, where the store cannot say
when it may (see the module)."""
LATE: Final = 60.0
"""Seconds behind the cursor over which a late event is still told apart from one delivered."""
POLL: Final = 0.1
"""Seconds between two reads of the journal, at least."""
BUSY: Final = 0.2
"""The share of its time a stream may spend reading, at most: after a poll whose reads took `t`
seconds it waits ``max(POLL, t / BUSY)`` (the journal of a large run costs its database a scan of
the run's rows a read, 50 ms at 100,000 tasks: ten a second would keep a backend half busy for
each client watching)."""
BOUND: Final = 5.0
"""Seconds a transaction of orchestra's is waited for, at most, on PostgreSQL: one open longer
(its process stopped) is let go of, and what it commits comes late (see the module)."""
SWEEP: Final = 2.0
"""Seconds between two reads of the journal from `LATE` behind the cursor (see the module)."""

Key = tuple[float, int, int, int, str, str]

_RANKS: Final = {"admitted": 0, "ready": 1, "started": 2}
_ENDS: Final = frozenset({"succeeded", "failed", "skipped", "cancelled"})


def key_of(event: dict[str, Any]) -> Key:
    """An event's place in the journal: its time, then admitted / ready / started / the rest /
    the end, then its row's number, attempt, name and task (as the stores' readers order them)."""
    name = event["event"]
    rank = _RANKS.get(name, 4 if name in _ENDS else 3)
    return (
        float(event["at"]),
        rank,
        -1 if event["seq"] is None else int(event["seq"]),
        -1 if event["attempt"] is None else int(event["attempt"]),
        name,
        event["task_id"] or "",
    )


def _json(event: dict[str, Any]) -> str:
    # One line (`json.dumps` escapes every line break); non-finite floats cannot occur (times
    # and numbers the stores wrote).
    return json.dumps(event, separators=(",", ":"))


def encode(key: Key) -> str:
    # JSON keeps the float exact (repr) and escapes any line break a task id may hold.
    return json.dumps(list(key), separators=(",", ":"))


def decode(text: str) -> Key:
    """A `Last-Event-ID` back to its key; `ValueError` when it is not one this service sent."""
    try:
        at, rank, seq, attempt, name, task = json.loads(text)
        key = (float(at), int(rank), int(seq), int(attempt), str(name), str(task))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an event id of this service: {text[:80]!r}") from exc
    return key


class Cursor:
    """Where a stream stands in a run's journal, and what it delivered lately."""

    def __init__(self, after: Key | None, *, settle: float = SETTLE, late: float = LATE) -> None:
        self.position = after
        self.settle = settle
        self.late = late
        self.seen: set[Key] = set()
        self._resumed = after is not None
        # PostgreSQL's live starts (`running`): the tasks seen running whose start is not told
        # yet (the event to tell), and those whose start was told so, until their row tells it.
        self.starting: dict[str, dict[str, Any]] = {}
        self.started: set[str] = set()

    def running(self, run_id: str, leased: list[tuple[str, int]], at: float) -> None:
        """The tasks of the run leased now, (id, attempt), their starts to tell dated `at` (the
        horizon the lease was read after: nothing still to commit is dated before it, so a start
        told at it comes before its task's end, and after what was told before)."""
        for task_id, attempt in leased:
            if task_id not in self.started and task_id not in self.starting:
                self.starting[task_id] = {
                    "seq": None, "run_id": run_id, "task_id": task_id, "at": at,
                    "event": "started", "agent": None, "attempt": attempt, "detail": None,
                }  # fmt: skip

    def _by_row(self, journal: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`journal` with the live starts still to tell; a start a task's row tells (it ended)
        replaces the live one not told yet, and is not told again when the live one was."""
        for event in journal:
            if event["event"] != "started" or event["seq"] is not None:
                continue
            task_id = event["task_id"]
            self.starting.pop(task_id, None)
            if task_id in self.started:
                self.started.discard(task_id)
                self.seen.add(key_of(event))  # (read again by later polls: told already)
        return [*journal, *self.starting.values()] if self.starting else journal

    def take(
        self,
        journal: list[dict[str, Any]],
        now: float,
        *,
        final: bool,
        horizon: float | None = None,
    ) -> list[tuple[dict[str, Any], str]]:
        """The events of `journal` (the run's whole journal, now) to deliver next, each with its
        SSE id: those past the cursor and dated before `horizon` (the store's word that nothing
        dated earlier can still commit, read before `journal` was), else no later than
        `now - settle` (all of them when `final`), and late ones not delivered before."""
        if final:
            limit, exact = float("inf"), False
        elif horizon is not None:
            limit, exact = horizon, True  # (a transaction that started at it may write at it)
        else:
            limit, exact = now - self.settle, False
        if self.starting or self.started:
            journal = self._by_row(journal)
        keyed = sorted((key_of(e), e) for e in journal)  # (a stable order, whatever the store's)
        if self._resumed:
            # What the client saw before it reconnected: every event up to its cursor.
            self._resumed = False
            assert self.position is not None
            self.seen.update(k for k, _ in keyed if k <= self.position)
        out: list[tuple[dict[str, Any], str]] = []
        for key, event in keyed:
            if key[0] > limit or (exact and key[0] == limit):
                break
            if key in self.seen:
                continue
            if self.position is not None and key <= self.position:
                if key[0] < self.position[0] - self.late:
                    continue  # too old to tell from one delivered: a gap, not a repeat
            else:
                self.position = key
            self.seen.add(key)
            if event["seq"] is None and self.starting.get(event["task_id"]) is event:
                del self.starting[event["task_id"]]
                self.started.add(event["task_id"])
            assert self.position is not None
            out.append((event, encode(self.position)))
        if self.position is not None:
            oldest = self.position[0] - self.late
            self.seen = {k for k in self.seen if k[0] >= oldest}
        return out

    def since(self, *, late: bool = True, behind: float | None = None) -> float | None:
        """The wall time the next read of the journal may start at (None: from the start): with
        `late`, older events are either delivered or too late to be told apart (or, with
        `behind`, come no later than that many seconds behind the cursor); else what is older
        than the cursor is delivered, or comes late."""
        if self.position is None:
            return None
        if self._resumed:
            return self.position[0] - self.late
        return self.position[0] - ((self.late if behind is None else behind) if late else 0.0)


async def resume_after(
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            max_length=1000,
            description="Resume after this event (the `id` of the last event received).",
        ),
    ] = None,
) -> Key | None:
    """The cursor a reconnecting client sends; 400 when it is not one this service sent (checked
    before the stream begins: once it has, a refusal can no longer be answered)."""
    if last_event_id is None:
        return None
    try:
        return decode(last_event_id)
    except ValueError as exc:
        raise Refused(400, "invalid", str(exc), field="Last-Event-ID") from None


router = APIRouter(prefix="/api/runs", tags=["events"])


# The 200 answer as FastAPI documents a stream of `EventSourceResponse` (OpenAPI 3.2's item schema).
_STREAM: Final = {
    "description": "The run's journal as Server-Sent Events, ended by an `end` event.",
    "content": {
        "text/event-stream": {
            "itemSchema": {
                "type": "object",
                "properties": {
                    "data": {"type": "string"},
                    "event": {"type": "string"},
                    "id": {"type": "string"},
                    "retry": {"type": "integer", "minimum": 0},
                },
            }
        }
    },
}
KEEPALIVE: Final = 15.0
"""Seconds without an event after which the stream sends a keep-alive comment (FastAPI's own
streams' interval)."""


@router.get(
    "/{run_id}/events",
    response_class=StreamingResponse,
    dependencies=[Depends(require("read"))],
    responses={200: _STREAM, **responses(400, 401, 403, 404)},
)
async def events(
    run_id: RunPath,
    run: KnownRun,
    service: ServiceDep,
    after: Annotated[Key | None, Depends(resume_after)],
) -> StreamingResponse:
    """The run's journal as Server-Sent Events, live: each event's `data` is a journal event
    (`JournalEvent`), its `id` the stream's cursor (send it back as `Last-Event-ID` to resume).
    The stream ends with an `end` event (`{"run_id", "state": "closed" | "stopped", "status"}`)
    once nobody runs the run and it is closed or was stopped."""
    return StreamingResponse(
        _stream(service, run_id, after),
        media_type="text/event-stream",
        # As FastAPI's own streams: no cache keeps it, no proxy (nginx) holds it back.
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream(service: Any, run_id: str, after: Key | None) -> AsyncIterator[bytes]:
    """The stream's body: what each poll delivers, formatted by FastAPI's `format_sse_event`
    and sent as one chunk. Not a generator of `ServerSentEvent`s for FastAPI to send: each of
    those is a pydantic model, then passed through two memory streams and a checkpoint to the
    response, about a hundred microseconds of the event loop an event, which the run shares (a
    busy run's streams, one per client and dashboard page, fell seconds behind its journal);
    so the keep-alive comment is sent here too."""
    cursor = Cursor(after)
    swept = -math.inf
    sent = time.monotonic()
    while True:
        began = time.monotonic()
        last = await _over(service, run_id)
        final = last is not None
        horizon = None if final else await _horizon(service, run_id, cursor)
        sweep = final or time.monotonic() - swept >= SWEEP
        if sweep:
            swept = time.monotonic()
        # A SQLite run this process writes dates every event before its window is handed over:
        # one comes late by a hair at most (an attempt's end, counted from its own clock
        # readings), so its sweeps look `settle` back, not `late` (a minute of a busy run's
        # journal read and sorted every `SWEEP`: its stream's largest cost).
        near = horizon is not None and isinstance(service.store, SQLiteStore)
        since = cursor.since(late=sweep, behind=cursor.settle if near and not final else None)
        journal = await service.read(partial(service.store.events, since=since), run_id)
        reading = time.monotonic() - began
        # Each event encoded as the JSON it is (str, float, int, None): FastAPI's
        # `jsonable_encoder` walk of it cost three times the rest of its encoding.
        chunk = b"".join(
            format_sse_event(data_str=_json(event), id=event_id)
            for event, event_id in cursor.take(journal, time.time(), final=final, horizon=horizon)
        )
        if last is not None:
            yield chunk + format_sse_event(event="end", data_str=_json(last))
            return
        if chunk:
            yield chunk
            sent = time.monotonic()
        elif time.monotonic() - sent >= KEEPALIVE:
            yield KEEPALIVE_COMMENT
            sent = time.monotonic()
        await anyio.sleep(max(POLL, reading / BUSY))


async def _horizon(service: Any, run_id: str, cursor: Cursor) -> float | None:
    """The time before which the journal of `run_id` gains no more event (read before the
    journal is); None when the store cannot say (the settle window then). On PostgreSQL, the
    run's tasks running now as well, told to `cursor` (their starts are not journal rows)."""
    store = service.store
    if isinstance(store, SQLiteStore):
        # This process is the file's one service (`orchestra serve` locks it), so a run it runs
        # is written by its writer alone, which says what it holds unwritten. A run run
        # elsewhere (a program's own, on the same file) it cannot see into.
        run = store.open_runs.get(run_id)
        return None if run is None or run.closed else run.horizon()
    from ..stores._postgres._admin import watch  # (PostgreSQL's driver: the postgres extra)

    at, leased = await store.database.run(watch, run_id, cursor.settle, BOUND)
    cursor.running(run_id, leased, at)
    return float(at)


async def _over(service: Any, run_id: str) -> dict[str, Any] | None:
    """The stream's last word (`end`'s data) once nobody runs the run, here or elsewhere, and
    it is closed, or let go of open (stopped: resumable later, by a new stream); else None. A
    run whose process died is still held (its lease lapsed, not let go): it is taken over."""
    handle = service.handle(run_id)
    if handle is not None and not handle.done:
        return None
    run = await service.run_record(run_id, counts=False)
    if holder(run) is not None:
        return None
    closed = run.get("state") == "closed"
    if not closed and run.get("owner") is not None:
        return None
    result = None if handle is None else handle.result
    return {
        "run_id": run_id,
        "state": "closed" if closed else "stopped",
        "status": None if result is None else result.status,
    }
