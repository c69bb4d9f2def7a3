"""A durable run's idempotency keys: claimed, waited for and reused through the file.

A key is a row of the `keys` table, claimed by the first submitter in one ``BEGIN IMMEDIATE``
transaction (`_writes.claim_keys`: an insert that does nothing when the key is there, then a
read of who holds it): the claimer runs the task and writes the result into the row with the task's
end; a submitter that finds it claimed by a live task waits (the task stays claimed by `claim`,
never started; `_poll` asks the file every window) and ends with that result. A claim is kept live
by the owner's commits (a heartbeat each window while it holds one); a failed task releases its key
to the next submitter, a dead owner's claim is taken over after `key_lease`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from ..._task import CLAIMED, SUCCEEDED, TERMINAL
from . import _writes as writes

if TYPE_CHECKING:
    from collections.abc import Collection
    from concurrent.futures import Future

    from ..._record import Record
    from ._store import SQLiteStore

__all__ = ("Keys", "Owner")


class Owner(Protocol):
    """What the keys ask of their run (`SQLiteRun`)."""

    run_id: str

    @property
    def closed(self) -> bool: ...
    def touch(self, record: Record) -> None: ...
    def arm(self) -> None: ...
    def run_here(self, record: Record) -> None: ...
    def end_reused(self, record: Record, output: str, agent: str | None) -> None: ...
    def end_held(self, record: Record, error: str, error_type: str) -> None: ...


class Keys:
    """The keys of one run's tasks (a part of the run, holding it)."""

    def __init__(
        self, run: Owner, store: SQLiteStore, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self._run = run
        self._store = store
        self._loop = loop  # None: driven directly (the contract suite), nothing can wait
        # Claimed in the file by this run (key -> its task, until the task's end is committed),
        # and held by another task (key -> the task waiting for its result).
        self.claims: dict[str, Record] = {}
        self.waiting: dict[str, Record] = {}
        self._poller: asyncio.Task[None] | None = None
        # `_poll`'s question to the file while it waits for the answer: its tasks, its answer.
        self._asking: tuple[list[Record], Future[Any]] | None = None

    def close(self) -> None:
        """The run ends (`SQLiteRun.close`, before its last window): no more waiting. A key the
        file gave in answer to a question still open is the run's claim, for that window to
        release (else nobody would: another run of the key would wait out `key_lease`)."""
        if self._poller is not None:
            self._poller.cancel()
        asking, self._asking = self._asking, None
        if asking is not None:
            records, answer = asking
            try:
                answers = answer.result()
            except Exception:  # the file failed: the run's close reports it
                return
            for record, (verdict, _, _) in zip(records, answers, strict=True):
                if verdict == "mine":
                    self.claims[record.task.key] = record  # type: ignore[index]

    def results(self, keys: list[str]) -> list[tuple[str, tuple[str, str | None]]]:
        """The successes of `keys` that the window being written holds, for `written`."""
        unwritten = self._store.unwritten_keys
        return [(key, unwritten[key]) for key in keys if key in unwritten]

    def written(self, results: list[tuple[str, tuple[str, str | None]]]) -> None:
        """The window that held `results` is committed: they are in the file. Only those: a task
        that window wrote running may have succeeded while it was being committed, and its
        result waits for the next window (dropped here, the key would be released as failed)."""
        unwritten = self._store.unwritten_keys
        for key, result in results:
            if unwritten.get(key) is result:
                del unwritten[key]

    def reuse(self, records: list[Record]) -> None:
        """New tasks with keys: a key that succeeded before in this file (any run, any store
        object, any process) ends its task now with the stored result, without executing; a key
        nobody holds is claimed in the file, and its task runs; a key another live task holds
        makes this one wait for that task's result (`_poll`)."""
        run = self._run
        if run.closed:  # (a key taken over in a step that ended the run): nothing to claim
            return
        store = self._store
        unwritten = store.unwritten_keys
        rest: list[Record] = []
        for record in records:
            hit = unwritten.get(record.task.key)  # type: ignore[arg-type]
            if hit is not None:
                self._reused(record, *hit)
            elif record.state not in TERMINAL:
                rest.append(record)
        if rest:
            wanted = [(r.task.key, r.id) for r in rest]
            answers = store.call(
                writes.claim_keys, store.owner, run.run_id, wanted, time.time(), store.key_lease
            )
            self._answered(rest, answers)

    def _answered(self, records: list[Record], answers: list[tuple[str, Any, Any]]) -> None:
        run = self._run
        for record, (verdict, text, agent) in zip(records, answers, strict=True):
            key: str = record.task.key  # type: ignore[assignment]
            if verdict == "done":
                self._reused(record, text, agent)
            elif verdict == "mine" or self._loop is None:  # driven directly: nothing can wait
                self.claims[key] = record
                if record.state is CLAIMED:  # held by `claim` while it waited: run it now
                    run.run_here(record)
                elif record.state in TERMINAL:  # ended (cancelled) while the file answered:
                    run.touch(record)  # the next window releases the claim
            else:
                self.waiting[key] = record
        if self.claims:
            run.arm()  # a claim is kept live by a commit each window
        if self.waiting and self._poller is None and self._loop is not None:
            self._poller = self._loop.create_task(self._poll())

    def inherit(self, record: Record) -> bool:
        """`record` holds its key in the run now: if it took the key over from another task of
        the run (one that did not succeed, or that waits for it), the run's claim in the file (or
        its wait for another run's) passes to it. False when the run has neither: `record` claims
        the key as a new submission would (`reuse`)."""
        key: str = record.task.key  # type: ignore[assignment]
        if key in self.claims:  # live in the file: this task's end is the key's
            self.claims[key] = record
        elif key in self.waiting:  # another run's task holds it: this one waits for it too
            self.waiting[key] = record
        else:
            return False
        return True

    def took_over(self, record: Record) -> None:
        """`record` was made ready holding its key (a retry holds it already): `inherit`, or
        claim it in the file after this step of the memory run (`reuse` may end the task)."""
        if not self.inherit(record):
            if self._loop is None:
                self.reuse([record])
            else:
                self._loop.call_soon(self.reuse, [record])

    def _reused(self, record: Record, text: str, agent: str | None) -> None:
        if record.state not in TERMINAL:
            self._run.end_reused(record, text, agent)

    async def _poll(self) -> None:
        """Wait for the keys other tasks hold: every window, a task whose key's result is stored
        ends with it; one whose key was released (its task failed) or abandoned (its owner
        stopped committing for `key_lease`) claims it and runs."""
        run = self._run
        store = self._store
        waiting = self.waiting
        try:
            while waiting and not run.closed:
                await asyncio.sleep(store.window)
                unwritten = store.unwritten_keys
                for key in [k for k in waiting if k in unwritten]:  # this store's own runs
                    self._reused(waiting.pop(key), *unwritten[key])
                for key in [k for k, r in waiting.items() if r.state in TERMINAL]:
                    del waiting[key]
                records = list(waiting.values())
                if not records:
                    continue
                # They stay in `waiting` while the file answers: held back from `claim`.
                wanted = [(r.task.key, r.id) for r in records]
                asking = store.submit(
                    writes.claim_keys, store.owner, run.run_id, wanted, time.time(), store.key_lease
                )
                self._asking = (records, asking)
                answers = await asyncio.wrap_future(asking)
                self._asking = None
                # Each answer is for the task that waits for its key now: another may have
                # taken the key over in the run meanwhile (`inherit`).
                self._answered([waiting.pop(r.task.key, r) for r in records], answers)  # type: ignore[arg-type]
        except Exception as exc:  # the file failed: the waiting tasks fail, the run goes on
            for record in list(waiting.values()):
                run.end_held(
                    record,
                    f"waiting for the result of key {record.task.key!r}: {exc}",
                    type(exc).__name__,
                )
            waiting.clear()
        finally:
            self._poller = None

    def rows(
        self, keys: list[str], *, closing: bool = False, remote: Collection[str] = ()
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], tuple[float, str] | None]:
        """What this window writes of the keys this run claimed: the results of the ones whose
        task ended (a success for the waiters, a failure for the next submitter to take over),
        and a heartbeat for the ones still running. `closing`: the run is over (stopped, its
        unfinished tasks written down to resume): the claims left are released, as a failure
        would, so another run waiting for one takes it at once instead of waiting out the
        lease (the resumed run claims it again, or follows the run that took it), except the
        ones of tasks a worker process holds (`remote`: its completion is the key's)."""
        claims = self.claims
        if not claims:
            return [], [], None
        owner = self._store.owner
        now = time.time()
        succeeded: list[tuple[Any, ...]] = []
        failed: list[tuple[Any, ...]] = []
        unwritten = self._store.unwritten_keys
        for key in keys:
            record = claims.get(key)
            if record is None or record.state not in TERMINAL:
                continue
            del claims[key]
            hit = unwritten.get(key) if record.state is SUCCEEDED else None
            if hit is not None:
                succeeded.append((hit[0], hit[1], key, owner))
            else:
                failed.append((f"{record.state}: {record.error}", now, key, owner))
        if closing:
            for key, record in list(claims.items()):
                if record.state is not SUCCEEDED and record.id not in remote:
                    del claims[key]
                    failed.append(("released: its run ended first", now, key, owner))
        return succeeded, failed, (now, owner) if claims else None
