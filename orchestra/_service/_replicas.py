"""Replicas: several ``orchestra serve --dsn`` processes on one PostgreSQL database serve the same
runs, behind one address (a load balancer) or several.

Every replica lists and reads every run, and streams its events, from the database (the store's
journal): that needs nothing here. What does, with two tables of the service's (schema v5):

- **Control from any replica.** A run's coordinator is one process (its lease on the run), and its
  `RunHandle` lives there. A replica asked to pause, resume, cancel, stop or reprioritize a run
  another replica runs (or to give its status) writes the request as a row of
  ``service_control`` and notifies; the replica that runs it takes the row, acts on its handle
  (`_control.act`, as for a request of its own) and writes the answer back, which the replica
  asked returns as it is. Through the database, not a redirect nor a proxy to the holder's
  address: behind a load balancer a client has one address and keeps its token (a redirect to
  another host drops the Authorization header in httpx and curl, and the replicas' own addresses
  are often not reachable from clients), the replicas need no address of each other's to be
  configured nor reach each other (only the database, which they reach already), and a request
  for a run whose replica just died waits for the replica that takes the run over, which answers
  it.
- **Take-over.** ``service_runs`` keeps each run a replica started: the request it came with, the
  replica that serves it (the name of its coordinator's lease), whether it was paused, and once it
  ended its `RunResult`. A replica that finds a run open whose coordinator's lease lapsed, served
  by another replica for longer than a lease, takes it (one statement: the other replicas see the
  row taken) and starts it again by its id: the store's resume (`stores/_resume.py`) gives back
  what ended, nothing is run again, and the tasks the dead replica was running run again (their
  lost attempt counted). Its input: none when the database holds the whole input (the run's input
  was closed: every task is in the database), else the request the run came with, admitted again
  and matched against what the database holds. A run that was paused is taken over paused.
- **Results.** A run that ended here has its `RunResult` written to its row, so that ``/result``
  answers it on every replica, and a run taken over is answered by its new replica.

A replica that shuts down gracefully (SIGTERM) stops its runs' attempts within its grace and gives
its runs up: another replica takes them over at once (their coordinator's lease was handed back).

Wake-ups are notifications on the channel ``orchestra_service`` (a request asked, an answer
written), with a poll behind them: a notification is a hint, the rows are the state.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._exceptions import StoreError
from .._log import get_logger
from ..stores._postgres._jobs import coordinator_name
from ._control import act
from ._errors import Refused
from ._models import SubmitRun

if TYPE_CHECKING:
    import asyncpg
    from anyio.abc import TaskGroup, TaskStatus

    from .._core._handle import RunHandle
    from .._spec import TaskSpec
    from ..stores._postgres._store import PostgresStore
    from ._state import Service

__all__ = ("CHANNEL", "Replicas")

CHANNEL: Final = "orchestra_service"
"""The channel of the replicas' notifications: ``ask`` (a control request written), ``answer:ID``
(the answer to request ID written)."""

POLL: Final = 0.5
"""Seconds between two looks at the tables when no notification came."""

ANSWER_WITHIN: Final = 10.0
"""Seconds past a lease that a control request waits for the replica that runs the run (a
take-over included) before it is answered 503."""

log = get_logger("orchestra")


class Replicas:
    """This replica among the others on `store`'s database: its runs written down, the control
    requests it asks and answers, the runs it takes over (see the module)."""

    def __init__(self, service: Service, store: PostgresStore) -> None:
        self.service = service
        self.store = store
        self.name = coordinator_name(store)  # the name its runs' leases carry
        self.lease = store.lease
        self.closing = False  # shutting down: runs stopped now are given up, not ended
        self._tg: TaskGroup | None = None
        self._wake = anyio.Event()
        self._answers: dict[int, anyio.Event] = {}
        self._taking: set[str] = set()

    # -- the lifespan ----------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen for requests and answers, answer the requests for the runs live here, take over
        the runs other replicas left: until cancelled (the app's lifespan ends)."""
        from ..stores._postgres._listen import Listener

        async with (
            anyio.create_task_group() as tg,
            Listener(self.store.dsn, [CHANNEL], on_notify=self._heard, on_reconnect=self._look),
        ):
            self._tg = tg
            task_status.started()
            try:
                while True:
                    with anyio.move_on_after(POLL):
                        await self._wake.wait()
                    self._wake = anyio.Event()
                    await self._step(tg)
            finally:
                self._tg = None

    def _heard(self, channel: str, payload: str) -> None:
        if payload.startswith("answer:"):
            with contextlib.suppress(ValueError):
                waiter = self._answers.get(int(payload[7:]))
                if waiter is not None:
                    waiter.set()
            return
        self._wake.set()

    def _look(self) -> None:
        # The listener came back: what was notified meanwhile is lost; look now.
        self._wake.set()
        for waiter in self._answers.values():
            waiter.set()

    async def _step(self, tg: TaskGroup) -> None:
        if self.closing:
            return
        try:
            live = [run_id for run_id, h in self.service.live.items() if not h.done]
            if live:
                asked = await self.store.database.run(_take_requests, live, self.name)
                for row in sorted(asked, key=lambda r: r["id"]):
                    if row["op"] == "stop":  # it waits for the grace: the others go on
                        tg.start_soon(self._answer, row)
                    else:
                        await self._answer(row)
            taken = await self.store.database.run(_take_over, self.name, self.lease)
            for row in taken:
                if row["id"] not in self._taking:
                    self._taking.add(row["id"])
                    tg.start_soon(self._resume, row)
        except Exception as exc:  # the database away for a moment: the next step tries again
            log.warning("replicas: a look at the database failed", error=str(exc))

    # -- runs started here -----------------------------------------------------------------------

    async def register(self, run_id: str, submission: dict[str, Any], paused: bool) -> bool:
        """Write down that this replica starts `run_id` with `submission` (the request's
        ``tasks`` or ``input``), `paused` or not; True when the database had no row of it yet."""
        new: bool = await self.store.database.run(
            _register, run_id, self.name, json.dumps(submission), paused
        )
        return new

    async def forget(self, run_id: str) -> None:
        """The run's start was refused (bad input): no replica is to take it over."""
        await self.store.database.run(_forget, run_id, self.name)

    def follow(self, handle: RunHandle) -> None:
        """Once the run of `handle` ends here, write its `RunResult` down for every replica."""
        if self._tg is not None:
            self._tg.start_soon(self._ended, handle)

    async def _ended(self, handle: RunHandle) -> None:
        try:
            result = await handle
            text: str | None = result.model_dump_json()
        except StoreError:
            # The database lost (or the run's lease, taken over while this replica was cut off
            # from it): the run goes on elsewhere, once another replica takes it over.
            return
        except Exception:  # a run that ended without a result: nothing to answer by
            text = None
        if self.closing:  # stopped by the shutdown: given up, for another replica to take over
            return
        # The database away: the result is not kept (every task's end is, and the run is over:
        # nobody takes it over).
        with contextlib.suppress(Exception):
            await self.store.database.run(_ended, handle.run_id, self.name, text)

    async def paused(self, run_id: str, paused: bool) -> None:
        """Write down that the run was paused or resumed: a replica that takes it over keeps it
        so."""
        await self.store.database.run(_paused, run_id, paused)

    async def is_paused(self, run_id: str) -> bool:
        """Whether the run is paused as the replicas wrote it down (`paused`): for a run another
        replica runs."""
        return bool(await self.store.database.run(_is_paused, run_id))

    async def result(self, run_id: str) -> dict[str, Any] | None:
        """The `RunResult` (as JSON) a replica wrote down when the run ended there, or None."""
        text = await self.store.database.run(_result, run_id)
        return None if text is None else dict(json.loads(text))

    # -- control asked of another replica ----------------------------------------------------------

    async def passes_on(self, run_id: str) -> bool:
        """Whether a control request for `run_id`, which does not run here, is passed on through
        the database: another replica serves it (or did until it died, and one will take it
        over), or this one is taking it over now (its request is answered once it runs here)."""
        replica = await self.store.database.run(_replica, run_id)
        return replica is not None and (replica != self.name or run_id in self._taking)

    async def ask(
        self, run_id: str, op: str, args: dict[str, Any], *, within: float | None
    ) -> dict[str, Any]:
        """`op` with `args` asked of the replica that runs `run_id`, through the database: its
        answer, or its refusal raised as a `Refused`. Waits up to a lease plus `ANSWER_WITHIN`
        seconds (plus `within`, a stop's grace; None: as long as the stop takes), then 503."""
        request: int = await self.store.database.run(_ask, run_id, op, json.dumps(args))
        waiter = self._answers[request] = anyio.Event()
        limit = math.inf if within is None else self.lease + ANSWER_WITHIN + within
        answered = False
        try:
            with anyio.move_on_after(limit):
                while True:
                    found = await self.store.database.run(_answered, request)
                    if found is not None:
                        answered = True
                        status, answer = found[0], json.loads(found[1])
                        if status >= 400:
                            raise Refused(
                                status, answer["error"], answer["message"], field=answer["field"]
                            )
                        return dict(answer)
                    with anyio.move_on_after(POLL):
                        await waiter.wait()
                    waiter = self._answers[request] = anyio.Event()
        finally:
            self._answers.pop(request, None)
            if not answered:  # timed out, or the client went away: nobody reads the answer
                with anyio.CancelScope(shield=True):
                    withdrawn = await self.store.database.run(_withdraw, request)
        raise Refused(
            503,
            "unavailable",
            f"the replica that runs run {run_id!r} did not answer within {limit:.0f} s"
            + (" (nor did any replica take the run over)" if withdrawn else "")
            + ": ask again",
            field="run_id",
            headers={"Retry-After": "5"},
        )

    async def _answer(self, row: Any) -> None:
        """Act on a request another replica wrote for a run live here, and write the answer."""
        run_id, op = row["run_id"], row["op"]
        handle = self.service.handle(run_id)
        try:
            if handle is None or handle.done:
                raise Refused(
                    409,
                    "not_running",
                    f"run {run_id!r} ended before the request reached it",
                    field="run_id",
                )
            answer = await act(handle, op, json.loads(row["args"]))
            if op in ("pause", "resume"):
                await self.paused(run_id, handle.paused)
            status = 200
        except Refused as exc:
            status = exc.status
            answer = {"error": exc.code, "message": exc.message, "field": exc.field}
        except Exception as exc:  # what the run raised (a stop of a run that failed)
            status = 409
            answer = {
                "error": "run_failed",
                "message": f"run {run_id!r} could not do it: {exc}",
                "field": "run_id",
            }
        with contextlib.suppress(Exception):  # the asker times out and says so
            await self.store.database.run(_answer, row["id"], status, json.dumps(answer))

    # -- take-over -------------------------------------------------------------------------------

    async def _resume(self, row: Any) -> None:
        run_id = row["id"]
        try:
            # Every task is in the database once the run's input was closed: nothing to admit
            # again (nor a decomposer to run again). Else the request, matched against them.
            tasks: list[TaskSpec] | None = []
            input: Any = None
            if not row["input_closed"]:
                submitted = SubmitRun.model_validate(json.loads(row["submission"]))
                tasks, input = submitted.tasks, submitted.input
            log.info("replicas: taking a run over", run_id=run_id)
            await self.service.submit(
                tasks=tasks, input=input, run_id=run_id, key=None, paused=row["paused"]
            )
        except Exception as exc:
            log.error("replicas: a run could not be taken over", run_id=run_id, error=str(exc))
            with contextlib.suppress(Exception):
                await self.store.database.run(_ended, run_id, self.name, None)
        finally:
            self._taking.discard(run_id)


# -- jobs of the store's database thread -----------------------------------------------------------


async def _register(
    conn: asyncpg.Connection, run_id: str, name: str, submission: str, paused: bool
) -> bool:
    # (`xmax = 0`: the row was inserted, not updated: PostgreSQL's way of telling the two apart)
    new: bool = await conn.fetchval(
        "INSERT INTO orchestra.service_runs AS s (id, replica, submission, paused) "
        "VALUES ($1, $2, $3::json, $4) ON CONFLICT (id) DO UPDATE "
        "SET replica = excluded.replica, since = now(), paused = excluded.paused, result = NULL "
        "RETURNING (xmax = 0)",
        run_id, name, submission, paused,
    )  # fmt: skip
    return new


async def _forget(conn: asyncpg.Connection, run_id: str, name: str) -> None:
    await conn.execute(
        "DELETE FROM orchestra.service_runs WHERE id = $1 AND replica = $2 AND result IS NULL",
        run_id, name,
    )  # fmt: skip


async def _ended(conn: asyncpg.Connection, run_id: str, name: str, result: str | None) -> None:
    # Only while this replica serves it: one that lost the run (its lease taken over while it
    # was cut off) leaves the row to the replica that took it.
    await conn.execute(
        "UPDATE orchestra.service_runs SET replica = NULL, result = $3::json "
        "WHERE id = $1 AND replica = $2",
        run_id, name, result,
    )  # fmt: skip


async def _paused(conn: asyncpg.Connection, run_id: str, paused: bool) -> None:
    await conn.execute(
        "UPDATE orchestra.service_runs SET paused = $2 WHERE id = $1", run_id, paused
    )


async def _is_paused(conn: asyncpg.Connection, run_id: str) -> bool | None:
    paused: bool | None = await conn.fetchval(
        "SELECT paused FROM orchestra.service_runs WHERE id = $1", run_id
    )
    return paused


async def _result(conn: asyncpg.Connection, run_id: str) -> str | None:
    text: str | None = await conn.fetchval(
        "SELECT result FROM orchestra.service_runs WHERE id = $1", run_id
    )
    return text


async def _replica(conn: asyncpg.Connection, run_id: str) -> str | None:
    name: str | None = await conn.fetchval(
        "SELECT replica FROM orchestra.service_runs WHERE id = $1", run_id
    )
    return name


async def _ask(conn: asyncpg.Connection, run_id: str, op: str, args: str) -> int:
    async with conn.transaction():
        request: int = await conn.fetchval(
            "INSERT INTO orchestra.service_control (run_id, op, args) VALUES ($1, $2, $3::json) "
            "RETURNING id",
            run_id, op, args,
        )  # fmt: skip
        await conn.execute("SELECT pg_notify($1, 'ask')", CHANNEL)
    return request


async def _answered(conn: asyncpg.Connection, request: int) -> tuple[int, str] | None:
    row = await conn.fetchrow(
        "DELETE FROM orchestra.service_control WHERE id = $1 AND status IS NOT NULL "
        "RETURNING status, answer",
        request,
    )
    return None if row is None else (int(row["status"]), str(row["answer"]))


async def _withdraw(conn: asyncpg.Connection, request: int) -> bool:
    """Take back a request whose answer nobody waits for any more: True when no replica had
    taken it (one that had acts on it all the same; its answer then updates no row)."""
    untaken: bool | None = await conn.fetchval(
        "DELETE FROM orchestra.service_control WHERE id = $1 RETURNING taken_by IS NULL", request
    )
    return bool(untaken)


async def _take_requests(conn: asyncpg.Connection, live: list[str], name: str) -> list[Any]:
    rows = await conn.fetch(
        "UPDATE orchestra.service_control SET taken_by = $2 WHERE id IN ("
        "SELECT id FROM orchestra.service_control WHERE taken_by IS NULL "
        "AND run_id = ANY($1::text[]) ORDER BY id FOR UPDATE SKIP LOCKED) "
        "RETURNING id, run_id, op, args",
        live, name,
    )  # fmt: skip
    return list(rows)


async def _answer(conn: asyncpg.Connection, request: int, status: int, answer: str) -> None:
    async with conn.transaction():
        await conn.execute(
            "UPDATE orchestra.service_control SET status = $2, answer = $3::json WHERE id = $1",
            request, status, answer,
        )  # fmt: skip
        await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, f"answer:{request}")


# A run another replica served for longer than a lease, left open with its coordinator's lease
# lapsed: taken by this replica, in one statement (a second replica running it at once waits for
# the row, then finds it taken: its `since` is now). Served for longer than a lease: a replica
# that just started a run has not taken the run's lease yet.
_TAKE_OVER = """
UPDATE orchestra.service_runs AS s SET replica = $1, since = now()
FROM orchestra.runs AS r
WHERE r.id = s.id AND s.replica IS NOT NULL AND s.replica <> $1
    AND s.since < now() - make_interval(secs => $2)
    AND r.state = 'open' AND (r.owner IS NULL OR r.expires IS NULL OR r.expires < now())
RETURNING s.id, s.submission, s.paused, r.input_closed
"""


async def _take_over(conn: asyncpg.Connection, name: str, lease: float) -> list[Any]:
    return list(await conn.fetch(_TAKE_OVER, name, lease))
