"""A run on PostgreSQL, as its coordinator sees it: the run's state lives in the database; the
coordinator keeps a mirror of it, takes its tasks through the database like any worker, and hears
the ends the others write.

**Shape.** The engine calls a `RunStore` synchronously, with live records, so `PostgresRun` holds a
`MemoryRun` — the *mirror*: every task of the run, its state and its place in the graph — and
keeps it in step with the database:

- **Input** is checked and named by the mirror (the engine's `InputError` comes from there, before
  anything is written), then written behind, in order, by one writer (`jobs.apply`) inside the fence
  of the coordinator's lease on the run (`_coordinator.fenced`); the database checks it again.
- **Claims** go through the database only (`_leases.claim`, sized by what the run's agents can
  start: `Listener.room`; while the run is busy, a small room waits a moment for more: `WORTH`),
  whatever the mirror says is ready: a task the mirror holds as ready may be a worker's at this
  moment. A claimed task waits in `_runnable` until the engine's `claim` takes it. Its attempt's
  end goes back with its lease's token (`_leases.complete`, which settles its dependents in the
  same transaction); its failed attempts as they fail (`_leases.note`).
- **Ends written elsewhere** (a worker's completion, a lease lost too often) are heard from the
  database's feed (`_follow.heard`) and played into the mirror as if they had happened here:
  the engine's report, events, results and aggregate see every end once.
- **Ends only the coordinator decides** (a cancel, a deadline passed) are written as such
  (`_follow.decide`), fenced by the run's lease.

The mirror computes what the database computes (readiness, cascades, groups: the same checks and
the same rules, model-tested against each other), so that its ready tasks are the database's.

**Where the work happens.** With a running loop, the writes go through one writer task and the
claims through one claimer task on the run's loop, each awaiting the store's database thread
(`_database.py`); the run's lease, the leases of the tasks it holds and its LISTEN run there, in the
background (`_keep`). Without a loop (the store contract suite drives a run by hand), every call
writes and claims at once, blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any, Final

from pydantic_core import to_json

from ..._exceptions import StoreError
from ..._log import get_logger
from ..._output import jsonable, stored_json
from ..._task import READY, SUCCEEDED, TERMINAL, Attempt, Task
from .._memory import MemoryRun
from .._protocol import KEEP
from .._resume import Resume
from . import _coordinator as coordinator
from . import _jobs as jobs
from . import _keys as keys
from . import _leases as leases
from ._behind import Behind
from ._graph import row_json
from ._hearing import Hearing
from ._listen import Wakeup, channel_of
from ._rows import CHUNK, Rows, ended_after

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from concurrent.futures import Future

    from ..._admission import Admission
    from ..._record import Record
    from .._protocol import Listener, Selector
    from ._store import PostgresStore

__all__ = ("PostgresRun",)

log = get_logger("orchestra")

BUSY: Final = 64
"""Ends heard in one read of the feed from which the run counts as busy: its next look waits
`PACE` seconds (unless `LAST` tasks or fewer are left), and claims for its agents a room of `WORTH`
or more at once, a smaller one `HOLD` seconds later."""

PACE: Final = 0.02
"""Seconds a busy run's coordinator lets pass before it looks at the database again. A look (a
read of the feed, a claim for its agents' room) costs its round trips and two hops between the
run's thread and the store's, whatever it brings; woken by each completion's notification, a
coordinator would read the ends of two workers a few dozen at a time. Paced, it hears them by
the hundred, at most this much later, for about half the CPU a task; its own agents claim once a
look, as many tasks as they have room for (`WORTH`, `HOLD`: a slot that frees meanwhile waits
for a later look, as a worker's does for its next burst). A run whose reads bring a few ends at
a time (one task after another, say) is not paced: each is heard as soon as it is announced."""

LAST: Final = 4 * BUSY
"""Unfinished tasks at most from which a busy run is not paced: its last ends (the last batches
of its workers, all under way) are heard as they are announced, not a `PACE` later — the run's
result waited for that pace (a few per cent of a one-second run), for a few reads saved."""

WORTH: Final = 16
"""The least room for which a busy run's coordinator claims tasks for its own agents at once (a
run not busy claims any room). A claim costs the database about as much for one task as for a
hundred (a walk of the run's ready tasks past those other claims took, a commit), and a task
claimed costs the coordinator a completion of its own, written alone: a one-slot agent claiming a
task a look cost the whole run (the database, the coordinator, its thread) about 6 us per task of
100,000 that two workers ran, for the 150 it took. A smaller room waits for more, `HOLD` at most."""

HOLD: Final = 0.25
"""Seconds at most a busy run's coordinator holds back a claim for a room under `WORTH`: its
agents' few slots still take tasks a few times a second (a kind only they serve is never left
to wait for the workers' whole run), not once every look."""


def waits_for_more(room: int, busy: bool, since: float | None, now: float) -> bool:
    """Whether a claim for `room` tasks waits (`WORTH`, `HOLD`): `since`, when a room under
    `WORTH` was first held back (None: it was not)."""
    return busy and 0 < room < WORTH and (since is None or now - since < HOLD)


class PostgresRun:
    """One run of a `PostgresStore`, as its coordinator sees it (module docstring)."""

    read_ahead = CHUNK  # a resumed stream's ended rows read at a time (`_read_ahead`)

    def __init__(
        self,
        store: PostgresStore,
        run_id: str,
        admission: Admission,
        listener: Listener,
        clock: Callable[[], float],
        task_timeout: float | None,
        compact: bool,
    ) -> None:
        self.run_id = run_id
        self._store = store
        self._db = store.database
        self._listener = listener
        self._memory = memory = MemoryRun(run_id, admission, self, clock, task_timeout, compact)
        self._wall0 = time.time()  # the wall time of the mirror's zero (`memory.t0`)
        self._kinds = sorted(admission.kinds)
        # This process, as the database knows it: the run's lease and its tasks' leases.
        self.name = jobs.coordinator_name(store)
        # The tasks this process holds under a lease of the database: id -> its claim.
        self._held: dict[str, leases.Claimed] = {}
        self._lost: set[str] = set()  # held once, taken back since (`_leases_lost`)
        # Claimed here, not handed to the engine yet: (priority, order, record), best first.
        self._runnable: list[tuple[int, int, Record]] = []
        self._order = 0
        self._error: BaseException | None = None
        self.closed = False
        self._ending: list[Record] | None = None  # the mirror's ends during a cancel
        self._failing: list[tuple[str, Any]] | None = None  # writes that follow a failure's note
        self.refused = 0  # completions of this process the database refused (a lost lease)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand (the contract suite): every call writes at once
            self._loop = None
        taken, rows, attempts, held_back, ahead = self._db.call(
            jobs.open_run, run_id, self.name, store.lease, compact
        )
        if isinstance(taken, coordinator.Holder):
            raise StoreError(
                f"run {run_id!r} is being run by another coordinator ({taken.owner}, its lease "
                f"good for {max(taken.remaining, 0):.1f} s more): a run has one coordinator; "
                "more processes join it as workers (`orch.work(store)`, `orchestra worker "
                "--dsn ...`), or run this again once it is over"
            )
        self._lease: coordinator.Lease = taken
        # What an earlier coordinator left of the run, taken back when the input comes again.
        reader = Rows(self._wall0, self._wall0 - memory.t0)
        # Read ahead (`_read_ahead`): the rows admitted before `ahead` (by earlier processes)
        # that had ended by then, after the last one read; not the ones unfinished then, taken
        # back now and heard when they end here.
        self._ahead = ahead
        self._after = (-1, "")
        self._taken_back = {row[0] for row in rows} if ahead is not None else set()
        self._reading: Future[Any] | None = None  # the next chunk, read while the input waits
        self._resume = Resume(
            run_id, admission, reader,
            (rows, attempts) if rows or ahead is not None else None,
            None if ahead is None else self._read_ahead,
        )  # fmt: skip
        del memory
        self._wakeup = Wakeup()
        self._hearing = Hearing(
            run_id, self._memory, self._held, reader, self._loop, self._wakeup,
            self._keep_error,
        )  # fmt: skip
        self._keyed = bool(held_back)  # this run holds or waits for keys: renew, release them
        # The tasks an earlier coordinator left held back for their keys: asked for again at
        # once, when the input starts coming (`_take_back`); the database is not looked at
        # before (what it answered for a task the mirror does not have yet would be lost).
        self._held_back: list[tuple[str, str]] | None = held_back
        self._tasks: list[asyncio.Task[None]] = []
        self._background: Future[Any] | None = None
        self._behind = Behind(
            self._db, run_id, self._lease, admission, self._loop, self._applied, self._keep_error
        )
        self._queue = self._behind.queue
        if self._loop is not None:
            self._tasks = [
                self._loop.create_task(self._claim_loop(), name=f"orchestra-pg-claim:{run_id}")
            ]
            self._background = self._db.spawn(self._keep)

    # -- counters (the mirror's) -----------------------------------------------------------------

    @property
    def unfinished(self) -> int:
        return self._memory.unfinished

    @property
    def resumed(self) -> int:
        """Tasks that had ended in an earlier coordinator, heard so far (`Resume.ended`)."""
        return self._resume.ended

    @property
    def pending(self) -> int:
        return self._memory.pending

    # -- the mirror's listener -------------------------------------------------------------------

    @property
    def quiet(self) -> list[Any] | None:
        """The run's (`Listener.quiet`): the mirror may put a plain success there rather than
        tell this listener, which would only pass it on (it writes nothing for an end; it
        collects the ends of a cancel, `cancel`, which ends no task as a success)."""
        return self._listener.quiet

    def ready(self, record: Record) -> None:
        claimed = self._held.pop(record.id, None)
        if claimed is not None:
            # A task of ours ready again (a retry due, a fallback): back in the database's
            # queue, behind its equals as in memory, for whoever has room (its failed attempt
            # is written first: `fail` queues the requeue after its note).
            requeue = ("requeue", (claimed.run_id, claimed.id, claimed.token, record.priority))
            if self._failing is not None:
                self._failing.append(requeue)
            else:
                self._queue(*requeue)
        self._listener.ready(record)

    def ready_all(self, records: Sequence[Record]) -> None:
        self._listener.ready_all(records)

    def finished(self, record: Any) -> None:
        if self._ending is not None:
            self._ending.append(record)
        self._listener.finished(record)

    def wake(self) -> None:
        self._listener.wake()

    def stop(self, reason: str) -> None:
        self._listener.stop(reason)

    def hold(self, held: bool) -> None:
        self._listener.hold(held)

    def room(self, kind: str, *, hold: bool = True) -> int:
        return self._listener.room(kind, hold=hold)

    def stalled(self, longer_than: float) -> list[str]:
        return self._listener.stalled(longer_than)

    # -- admission -------------------------------------------------------------------------------

    def admit(
        self,
        tasks: Sequence[Any],
        *,
        where: str,
        forward: bool,
        first_index: int = 0,
    ) -> int:
        self._take_back()
        _storable(tasks, where)
        added, stretches = self._resume.admit(
            self._memory, tasks, where=where, forward=forward, first_index=first_index
        )
        # Each row is written at its task's place in the input: the stretches the mirror
        # admitted (around what a resume found done), each from its own first index.
        for start, stop in stretches:
            kept = list(tasks[start:stop])
            self._queue(
                "admit",
                (
                    kept, where, forward, first_index + start, self._keys_of(kept),
                    self._generated(kept),
                ),
            )  # fmt: skip
        return added

    def admit_one(self, task: Any, index: int) -> None:
        self._take_back()
        _storable((task,), "input item")
        if self._resume.admit_one(self._memory, task, index):
            self._queue(
                "admit",
                (
                    [task], "input item", False, index, self._keys_of((task,)),
                    self._generated((task,)),
                ),
            )  # fmt: skip

    def close_input(self) -> None:
        self._take_back()
        self._resume.read_up_to(math.inf)  # what the input did not give again, heard now
        self._memory.close_input()
        self._queue("close_input", None)

    def _read_ahead(self) -> tuple[list[Any], list[Any], int | None]:
        """The next chunk of the run's ended rows, for `Resume` to read ahead of the input."""
        assert self._ahead is not None
        chunk = self.read_ahead
        reading, self._reading = self._reading, None
        if reading is not None:  # asked for by `backpressure`: its answer, or waited for
            rows, attempts = reading.result()
        else:
            rows, attempts = self._db.call(
                ended_after, self.run_id, self._after, self._ahead, chunk
            )
        read = len(rows)
        if read:
            self._after = Rows.position(rows[-1])
        taken_back = self._taken_back
        if taken_back:
            rows = [row for row in rows if row[0] not in taken_back]
        if read < chunk:
            return rows, attempts, None
        return rows, attempts, self._after[0]

    def _generated(self, tasks: Sequence[Any]) -> set[str]:
        """The ids of `tasks` the mirror generated (given none): the writer behind sees every
        task named by then, and the row must say which were not, for a resumed run to generate
        them again (written as named, a resume took them for the caller's own and gave the same
        input new ids: every task of the run ran again)."""
        memory = self._memory
        generated = set()
        for task in tasks:
            record = memory.record_of(task.id)
            if record is not None and not record.named:
                generated.add(task.id)
        return generated

    def _keys_of(self, tasks: Sequence[Any]) -> list[tuple[str, str]]:
        """The keys the run's new tasks hold in the run (a follower of another task of the run
        claims none: it ends with its holder), as (key, task id), to claim across runs."""
        memory = self._memory
        wanted = []
        for task in tasks:
            key = getattr(task, "key", None)
            if key is None:
                continue
            record = memory.record_of(task.id)
            if record is not None and record.state not in TERMINAL and memory.holds_key(record):
                wanted.append((key, task.id))
        if wanted:
            self._keyed = True
        return wanted

    def _take_back(self) -> None:
        """What an earlier coordinator left of this run, taken back as the input starts coming
        (the ends it saw heard by the run; what other processes hold stays theirs: ready in the
        mirror, claimed in the database until they end it or their lease lapses)."""
        self._resume.take_back(self._memory, self._listener, _NO_REMOTE)
        held_back = self._held_back
        if held_back is not None:
            self._held_back = None  # the mirror has every task now: the claimer may look
            for key, task_id in held_back:
                self._hearing.wait_key(key, task_id, 0.0)
            self._wakeup.set()

    def backpressure(self) -> asyncio.Future[Any] | None:
        behind = self._behind.backpressure()
        if behind is not None or self._loop is None or self._ahead is None:
            return behind
        # A resumed stream's next chunk of ended rows is read while the input waits for it, half
        # a chunk ahead: the input (matched, not run) never waits on the writer, and it would
        # otherwise take every chunk in one turn of the loop, the run deaf (no status) meanwhile.
        reading = self._reading
        if reading is None and self._resume.wants(self.read_ahead // 2):
            reading = self._reading = self._db.submit(
                ended_after, self.run_id, self._after, self._ahead, self.read_ahead
            )
        if reading is not None and not reading.done():  # a resolved one: read, not awaited again
            return asyncio.wrap_future(reading, loop=self._loop)
        return None

    def check_spawn(self, task: Task, parent: Any, pending: dict[str, Task]) -> None:
        self._memory.check_spawn(task, parent, pending)
        _storable((task,), f"task spawned by {parent.id!r}")

    # -- dispatch --------------------------------------------------------------------------------

    def claim(self) -> Record | None:
        record = self._pop()
        if record is None:
            if self._loop is None:
                self._step(limit=1)
                record = self._pop()
            else:  # nothing claimed here: look in the database
                self._wakeup.set()
        return record

    def _pop(self) -> Record | None:
        runnable = self._runnable
        held = self._held
        while runnable:
            priority, _, record = heappop(runnable)
            if record.state is not READY or record.id not in held:
                continue  # ended meanwhile (a cancel, a deadline), or its lease lost
            if record.priority != priority:  # moved since (`reprioritize`): to its new place
                self._push(record)
                continue
            self._memory.take(record)
            return record
        return None

    def _push(self, record: Record) -> None:
        self._order += 1
        heappush(self._runnable, (record.priority, self._order, record))

    def _taken(self, kind: str) -> int:
        return sum(1 for _, _, r in self._runnable if r.kind == kind and r.state is READY)

    def heartbeat(self, record: Any, token: int) -> bool:
        return self._memory.heartbeat(record, token)

    def start(self, record: Any, token: int, agent: str) -> bool:
        return self._memory.start(record, token, agent)

    def fail(
        self,
        record: Any,
        token: int,
        attempt: Attempt,
        *,
        retry_at: float | None = None,
        next_agent: str | None = KEEP,
    ) -> bool:
        claimed = self._held.get(record.id)
        after: list[tuple[str, Any]] = []
        self._failing = after
        try:
            if not self._memory.fail(
                record, token, attempt, retry_at=retry_at, next_agent=next_agent
            ):
                return False
        finally:
            self._failing = None
        if claimed is not None:
            self._queue("note", (record.id, claimed.token, self._failed(attempt)))
        for op in after:
            self._queue(*op)
        return True

    def note(self, record: Any, token: int, feedback: str, *, partial: Any = KEEP) -> bool:
        return self._memory.note(record, token, feedback, partial=partial)

    def settle(
        self,
        record: Any,
        token: int,
        status: str,
        output: Any = None,
        *,
        spawned: Sequence[Task] = (),
        agent: str | None = None,
        error: str | None = None,
        error_type: str | None = None,
        defaulted: bool = False,
        attempt: Attempt | None = None,
    ) -> bool:
        if record.token != token or record.state in TERMINAL:
            return False
        text: str | None = None
        if status is SUCCEEDED:
            # Raised where the attempt ends, before any change: it fails that attempt.
            text = stored_json(output, record.id, agent)
        if spawned:
            _storable(spawned, f"tasks spawned by {record.id!r}")
            if not self._keyed and any(t.key is not None for t in spawned):
                self._keyed = True  # their completion claims their keys for the run: renewed
        if not self._memory.settle(
            record, token, status, output, spawned=spawned, agent=agent, error=error,
            error_type=error_type, defaulted=defaulted, attempt=attempt,
        ):  # fmt: skip
            return False
        claimed = self._held.pop(record.id, None)
        if claimed is not None:
            failed = [] if attempt is None else [self._failed(attempt)]
            self._queue("end", (self._end_of(record, claimed.token, text), list(spawned), failed))
        elif record.id in self._lost:
            # Its lease was taken back: the end is not written under it (refused), but as the
            # run's decision, as a cancel is (a process that claimed it since is fenced off).
            self._lost.discard(record.id)
            self.refused += 1
            end = self._end_of(record, 0, text)
            self._queue(
                "decide", (record.id, status, error, error_type, end.output, agent, defaulted)
            )
        else:  # not a lease of ours: decided here (a deadline passed while it waited)
            end = self._end_of(record, 0, text)
            self._queue(
                "decide", (record.id, status, error, error_type, end.output, agent, defaulted)
            )
        return True

    def succeed(self, record: Any, token: int, output: Any, agent: str) -> bool:
        return self.settle(record, token, SUCCEEDED, output, agent=agent)

    def cancel(self, selector: Selector, reason: str, error_type: str = "Cancelled") -> list[Any]:
        ended = self._ending = []
        try:
            flagged = self._memory.cancel(selector, reason, error_type)
        finally:
            self._ending = None
        for record in ended:
            if record.status == "cancelled":  # (the skipped ones follow from it: settled there)
                self._held.pop(record.id, None)
                self._queue(
                    "decide", (record.id, "cancelled", reason, error_type, None, None, False)
                )
        return flagged

    def due(self, now: float) -> list[Any]:
        return self._memory.due(now)

    def next_due(self) -> float | None:
        return self._memory.next_due()

    # -- reading ---------------------------------------------------------------------------------

    def deps_of(self, record: Any) -> dict[str, Any]:
        return self._memory.deps_of(record)

    def results(self) -> Iterable[Any]:
        return self._memory.results()

    def state_of(self, task_id: str) -> str | None:
        return self._memory.state_of(task_id)

    def reprioritize(self, task_id: str, priority: int, *, claimed: bool = False) -> bool:
        if not self._memory.reprioritize(task_id, priority, claimed=claimed):
            return False
        self._queue("priority", (task_id, priority))
        return True

    # -- what the database made of the writes ---------------------------------------------------

    def _applied(self, done: jobs.Applied) -> None:
        refused = done.refused
        self._hearing.answered(done.answers)
        if refused:
            self.refused += len(refused)
            log.warning(
                "completion refused: the lease was lost", run_id=self.run_id, task_ids=refused
            )
        self._wakeup.set()  # what these writes made ready may be claimed now

    def _keep_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            if not self.closed:
                self._listener.stop(f"the run's database failed: {error}")

    # -- the claimer: tasks taken through the database, ends heard from it -----------------------

    def _rooms(self) -> dict[str, int]:
        listener = self._listener
        return {kind: listener.room(kind) - self._taken(kind) for kind in self._kinds}

    def _step(self, *, limit: int | None = None) -> None:
        """Hear the ends written elsewhere and claim what the agents can start (blocking)."""
        if self._held_back is not None:
            return  # the input has not started: the mirror would drop what is heard
        asked = self._hearing.keys_due()
        if asked:
            try:
                self._hearing.answered(
                    self._db.call(jobs.ask_again, self.run_id, self._lease, asked)
                )
            except BaseException as exc:
                self._keep_error(exc)
                return
        try:
            heard, claimed = self._db.call(
                jobs.claim_step, self.run_id, self._rooms(), self.name, self._store.lease, limit
            )
        except BaseException as exc:
            self._keep_error(exc)
            return
        self._take_in(heard)
        self._hand_out(claimed)

    def _take_in(self, heard: Any) -> None:
        if not self._keyed and any(
            spawn[7] is not None for spawns in heard.spawned.values() for spawn in spawns
        ):
            self._keyed = True  # spawns a worker admitted with keys: their holds are the run's
        self._hearing.take_in(heard)

    async def _claim_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        poll = self._store.poll
        every = self._store.lease / 3
        swept = -math.inf
        busy = False  # the last read heard BUSY ends or more
        small = None  # since when a small room waits (`waits_for_more`)
        while not self.closed:
            await self._wakeup.wait(max(0.0, min(poll, self._hearing.next_look() - loop.time())))
            if self.closed or self._error is not None:
                return
            if self._held_back is not None:
                continue  # the input has not started: the mirror would drop what is heard
            asked = self._hearing.keys_due()
            if asked:
                try:
                    answers = await self._db.run(jobs.ask_again, self.run_id, self._lease, asked)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    self._keep_error(exc)
                    return
                self._hearing.answered(answers)
            sweep = loop.time() - swept >= every
            if sweep:
                swept = loop.time()
            rooms = self._rooms()
            now = loop.time()
            if waits_for_more(sum(rooms.values()), busy, small, now):
                small = now if small is None else small
                rooms = {}
            else:
                small = None
            try:
                heard, claimed = await self._db.run(
                    jobs.claim_step, self.run_id, rooms, self.name, self._store.lease, None, sweep
                )
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._keep_error(exc)
                return
            if self._over():
                if claimed:  # not ours to run any more: back at once, no attempt counted
                    self._db.submit(
                        leases.release, self.name, [(c.run_id, c.id, c.token) for c in claimed]
                    )
                return
            self._take_in(heard)
            self._hand_out(claimed)
            busy = len(heard.ends) >= BUSY
            if busy and self._memory.unfinished > LAST:
                await asyncio.sleep(PACE)  # (what is announced meanwhile wakes the next look)

    def _over(self) -> bool:
        """Closed (read again after an await: `close` may have run meanwhile)."""
        return self.closed

    def _hand_out(self, claimed: list[leases.Claimed]) -> None:
        memory = self._memory
        early = []
        ended = 0
        for task in claimed:
            record = memory.record_of(task.id)
            if record is not None and record.state in TERMINAL:
                # Ended here after the database took its lease back (this process cut off for
                # a lease): the database learns that end now, under this fresh lease.
                self._queue("end", (self._end_of(record, task.token), [], []))
                ended += 1
                continue
            if record is None or record.state is not READY:
                # Made ready by an end this process has not heard yet (it came between the
                # feed's read and the claim): handed back, claimed again once heard.
                early.append(task)
                continue
            self._held[task.id] = task
            self._push(record)
        if early:
            back = [(c.run_id, c.id, c.token) for c in early]
            if self._loop is None:
                self._db.call(leases.release, self.name, back)
            else:
                self._db.submit(leases.release, self.name, back)
                self._wakeup.set()
        if self._loop is not None:
            for _ in range(len(claimed) - len(early) - ended):
                self._listener.wake()

    # -- the background, in the database's thread ------------------------------------------------

    async def _keep(self) -> None:
        """The run's lease kept, the held tasks' leases renewed, the run's channel listened to
        (in the store's thread, where a busy run loop cannot stall them)."""
        from ._listen import Listener

        store = self._store
        loop = self._loop
        assert loop is not None
        pool = await self._db.pool()

        def lost(lease: coordinator.Lease) -> None:
            loop.call_soon_threadsafe(
                self._keep_error,
                coordinator.LeaseLost(
                    f"run {self.run_id!r}: this coordinator ({self.name}) lost its lease on the "
                    "run (it was taken over, or the database was out of reach for a whole "
                    "lease): it stops, writing nothing more",
                    run_id=lease.run_id, owner=lease.owner, token=lease.token,
                ),
            )  # fmt: skip

        def woken(channel: str, payload: str) -> None:
            if channel == keys.KEY_CHANNEL:
                loop.call_soon_threadsafe(self._hearing.key_heard, channel, payload)
            else:
                self._wakeup.set_from(loop)

        def reconnected() -> None:
            loop.call_soon_threadsafe(self._hearing.reconnected)

        async with (
            coordinator.LeaseKeeper(pool, self._lease, on_lost=lost),
            Listener(
                self._db.dsn, [channel_of(self.run_id), keys.KEY_CHANNEL], on_notify=woken,
                on_reconnect=reconnected,
            ),
        ):  # fmt: skip
            while True:
                await asyncio.sleep(store.lease / 3)
                # (a copy: the run's loop changes the dict meanwhile; `dict.copy` is one step)
                if self._keyed:  # the run's holds of keys, renewed with its tasks' leases
                    with contextlib.suppress(StoreError):
                        await self._db.within(
                            keys.renew_run, self.run_id, self.name, lease=store.lease
                        )
                held = self._held.copy()
                if held:
                    with contextlib.suppress(StoreError):  # out of reach: the next beat tries
                        gone = await self._db.within(
                            leases.heartbeat,
                            self.name,
                            [(c.run_id, c.id, c.token) for c in held.values()],
                            lease=store.lease,
                        )
                        if gone:
                            loop.call_soon_threadsafe(self._leases_lost, {i for _, i in gone})

    def _leases_lost(self, lost: set[str]) -> None:
        """Leases of this process's tasks the database took back (its renewals did not get
        through for a whole lease): their ends are not this process's to write any more."""
        for task_id in lost:
            if self._held.pop(task_id, None) is not None:
                self._lost.add(task_id)
        if lost:
            log.warning("leases lost", run_id=self.run_id, task_ids=sorted(lost))

    def _end_of(self, record: Record, token: int, text: str | None = None) -> leases.End:
        """How an ended record ended, as the database writes it (`text`: its output's JSON,
        when the caller has it)."""
        if text is None and record.output is not None:
            if record.status is SUCCEEDED:
                text = stored_json(record.output, record.id, record.agent)
            else:  # a rejected output, kept as JSON can
                text = to_json(jsonable(record.output)).decode()
        started = None if record.t_start is None else self._wall(record.t_start)
        return leases.End(
            record.id, token, record.status, text, record.agent, record.error,
            record.error_type, record.attempts, record.defaulted, started,
        )  # fmt: skip

    def _wall(self, t: float) -> float:
        return self._wall0 + (t - self._memory.t0)

    def _failed(self, attempt: Attempt) -> leases.Failed:
        return leases.Failed(
            attempt.number, attempt.agent, attempt.error_type, attempt.message,
            self._wall0 + attempt.started, attempt.duration, attempt.retry_in, attempt.traceback,
            attempt.status_code, attempt.api_error_type, attempt.request_id,
        )  # fmt: skip

    # -- the end ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Write down everything, let go of what this process holds and of the run (closed when
        every task ended); raises `StoreError` if the database failed the run."""
        if self.closed:
            return
        self.closed = True
        for task in self._tasks:
            task.cancel()
        self._behind.close()
        if self._background is not None:
            self._background.cancel()
        done = self._error is None and not self._memory.unfinished
        held = [(c.run_id, c.id, c.token) for c in self._held.values()]
        self._held.clear()
        try:
            self._db.call(jobs.close_run, self._lease, held, done, self._keyed)
        except StoreError as exc:
            self._error = self._error or exc
        error = self._error
        if error is not None:
            if isinstance(error, StoreError):
                raise error
            raise StoreError(f"{self._store!r} could not write run {self.run_id!r}: {error}")


class _NoRemote:
    """A resumed run's tasks other processes hold need nothing at resume: the database keeps
    their leases, and their ends come through the feed."""

    def resume(self, records: Sequence[Record], rows: Sequence[Any]) -> int:
        return 0


_NO_REMOTE = _NoRemote()


def _storable(tasks: Sequence[Any], where: str) -> None:
    """Refuse a task whose payload or metadata JSON cannot hold, before anything is written (as
    the database's admission would, behind the run)."""
    for task in tasks:
        if isinstance(task, Task):
            row_json(task, where)
