"""Idempotency keys on PostgreSQL (`orchestra.stores._postgres._keys`), on the session's real server
and real connections: a key claimed by one of 100 concurrent submitters while the others see it
held, then all reuse its stored result; holds renewed, expired, taken over and adopted, failed keys
taken over; a keyed task's end written into its key with the completion that ends it (and none
when the completion is refused); a run's task whose key another run holds held back in the
database until the key is its own or its result is stored; 40 runs sharing keys end to end;
concurrent writers of shared keys that never deadlock; finishes announced on the key channel; and
a model check of the claims against the SQLite store's, step by step.

A lease is made to run out by moving its expiry into the past on the server, not by waiting."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
import pytest

from orchestra import Task
from orchestra._admission import Admission
from orchestra._task import CANCELLED, FAILED, SKIPPED, SUCCEEDED
from orchestra.stores._postgres._coordinator import acquire
from orchestra.stores._postgres._graph import admit
from orchestra.stores._postgres._keyed import (
    admit_keys,
    admit_spawned,
    ask_again,
    held_back,
    spawn_answers,
)
from orchestra.stores._postgres._keys import (
    KEY_CHANNEL,
    RECENT,
    Held,
    KeyEnd,
    Mine,
    Stored,
    Waiting,
    adopt,
    claim,
    finish,
    release_run,
    renew,
    renew_run,
    signal_of,
)
from orchestra.stores._postgres._leases import (
    MAX_LOST,
    End,
    complete,
    take_back_expired,
)
from orchestra.stores._postgres._leases import claim as claim_tasks
from orchestra.stores._postgres._listen import Listener
from orchestra.stores._postgres._settle import transaction
from orchestra.stores._sqlite import _writes as sqlite_writes
from orchestra.stores._sqlite._schema import migrate as sqlite_migrate

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

LEASE = 30.0


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def expire(conn: asyncpg.Connection, *keys: str) -> None:
    """The holds of these keys run out (their expiry a second ago, on the server's clock)."""
    await conn.execute(
        "UPDATE orchestra.keys SET expires = now() - interval '1 second' WHERE key = ANY ($1)",
        list(keys),
    )


async def key_row(conn: asyncpg.Connection, key: str) -> dict[str, Any]:
    found = await conn.fetchrow(
        "SELECT owner, token, run_id, task_id, state, output::text AS output, agent, error "
        "FROM orchestra.keys WHERE key = $1",
        key,
    )
    assert found is not None, f"no row for key {key!r}"
    return dict(found)


async def mine(
    conn: asyncpg.Connection, key: str, *, owner: str = "c1", run: str = "r", task: str = "t"
) -> int:
    """Claim `key` for task `task` of `run`, which must get it: its token."""
    (answer,) = await claim(conn, run, [(key, task)], owner=owner, lease=LEASE)
    assert isinstance(answer, Mine), answer
    return answer.token


async def admitted(conn: asyncpg.Connection, run: str, *tasks: Task) -> None:
    """Admit `tasks` into `run` (made if new), as a coordinator's admission writes them."""
    await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1) ON CONFLICT DO NOTHING", run)
    await admit(conn, run, tasks, admission=Admission(("work",), {}))


async def leased(conn: asyncpg.Connection, run: str, task_id: str, owner: str = "w1") -> int:
    """Lease the ready task `task_id` of `run` to the worker `owner`: its token."""
    claimed = await claim_tasks(conn, run, {"work": 100}, owner=owner, lease=LEASE)
    tokens = {task.id: task.token for task in claimed}
    assert task_id in tokens, f"{task_id} was not claimable: {sorted(tokens)}"
    return tokens[task_id]


class Heard:
    """The payloads a listener delivered on the key channel, and a way to wait for one."""

    def __init__(self) -> None:
        self.payloads: list[str] = []
        self._more = anyio.Event()

    def __call__(self, channel: str, payload: str) -> None:
        assert channel == KEY_CHANNEL
        self.payloads.append(payload)
        self._more.set()

    async def until(self, payload: str) -> None:
        with anyio.fail_after(10):
            while payload not in self.payloads:
                await self._more.wait()
                self._more = anyio.Event()


class TestClaim:
    async def test_a_new_key_is_the_claimers_under_a_fresh_token(
        self, conn: asyncpg.Connection
    ) -> None:
        first = await mine(conn, "k1", task="a")
        second = await mine(conn, "k2", task="b")
        assert second > first > 0
        row = await key_row(conn, "k1")
        assert (row["owner"], row["token"], row["run_id"], row["task_id"], row["state"]) == (
            "c1", first, "r", "a", "claimed",
        )  # fmt: skip

    async def test_a_key_a_live_task_holds_is_held_with_its_holder_and_the_lease_it_has_left(
        self, conn: asyncpg.Connection
    ) -> None:
        await mine(conn, "k", owner="c1", run="r1", task="a")
        (answer,) = await claim(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert isinstance(answer, Held)
        assert (answer.owner, answer.run_id, answer.task_id) == ("c1", "r1", "a")
        assert 0 < answer.left <= LEASE
        assert (await key_row(conn, "k"))["task_id"] == "a"  # unchanged

    async def test_many_keys_at_once_are_each_answered_for_their_task_in_order(
        self, conn: asyncpg.Connection
    ) -> None:
        held = await mine(conn, "held", owner="c1", run="r1", task="a")
        done = await mine(conn, "done", owner="c1", run="r1", task="b")
        assert await finish(conn, "c1", [KeyEnd("done", done, True, '{"x": 1}', "agent-1")]) == [
            True
        ]
        answers = await claim(
            conn, "r2", [("new", "n"), ("done", "d"), ("held", "h")], owner="c2", lease=LEASE
        )
        assert isinstance(answers[0], Mine)
        assert answers[1] == Stored('{"x": 1}', "agent-1")
        assert isinstance(answers[2], Held)
        assert (answers[2].run_id, answers[2].task_id) == ("r1", "a")
        assert (await key_row(conn, "held"))["token"] == held

    async def test_a_none_output_is_stored_as_json_null(self, conn: asyncpg.Connection) -> None:
        token = await mine(conn, "k")
        await finish(conn, "c1", [KeyEnd("k", token, True, None, "a")])
        assert await claim(conn, "r2", [("k", "x")], owner="c2", lease=LEASE) == [
            Stored("null", "a")
        ]

    async def test_the_holding_run_claiming_again_takes_its_hold_back_and_fences_the_old_token(
        self, conn: asyncpg.Connection
    ) -> None:
        # A standby coordinator resuming the run claims the keys of its tasks again: they are its
        # own, under a new token, and the paused old coordinator can no longer renew or end them.
        old = await mine(conn, "k", owner="old", run="r", task="a")
        new = await mine(conn, "k", owner="standby", run="r", task="a")
        assert new > old
        assert await renew(conn, "old", [("k", old)], lease=LEASE) == {"k"}
        assert await finish(conn, "old", [KeyEnd("k", old, False, error="late")]) == [False]
        row = await key_row(conn, "k")
        assert (row["owner"], row["token"], row["state"]) == ("standby", new, "claimed")

    async def test_a_hold_is_its_runs_whichever_of_its_tasks_claims_it(
        self, conn: asyncpg.Connection
    ) -> None:
        # (the run's graph makes the others follow the one that holds it: one piece of work)
        first = await mine(conn, "k", run="r", task="a")
        second = await mine(conn, "k", run="r", task="b")
        assert second > first
        (answer,) = await claim(conn, "other", [("k", "c")], owner="c2", lease=LEASE)
        assert isinstance(answer, Held)
        assert (answer.run_id, answer.task_id) == ("r", "b")

    async def test_a_coordinator_taking_the_run_over_adopts_all_its_holds(
        self, conn: asyncpg.Connection
    ) -> None:
        old = {key: await mine(conn, key, owner="old", run="r", task=key) for key in ("k", "j")}
        done = await mine(conn, "done", owner="old", run="r", task="d")
        await finish(conn, "old", [KeyEnd("done", done, True, "1", "a")])
        await mine(conn, "elsewhere", owner="c2", run="r2", task="e")
        adopted = await adopt(conn, "r", owner="standby", lease=LEASE)
        assert sorted(adopted) == ["j", "k"]
        assert all(adopted[key] > old[key] for key in adopted)
        assert await renew(conn, "old", list(old.items()), lease=LEASE) == {"j", "k"}
        assert await renew(conn, "standby", list(adopted.items()), lease=LEASE) == set()
        assert (await key_row(conn, "elsewhere"))["owner"] == "c2"

    async def test_tasks_of_a_run_wanting_one_key_get_one_answer(
        self, conn: asyncpg.Connection
    ) -> None:
        answers = await claim(
            conn, "r", [("k", "a"), ("j", "b"), ("k", "c")], owner="c", lease=LEASE
        )
        assert isinstance(answers[0], Mine)
        assert answers[2] == answers[0]
        assert (await key_row(conn, "k"))["task_id"] == "a"
        again = await claim(conn, "r2", [("k", "x"), ("k", "y")], owner="c2", lease=LEASE)
        assert again[0] == again[1] == Held("c", "r", "a", again[0].left)  # type: ignore[union-attr]


class TestOneHundredConcurrentSubmissions:
    async def test_one_holds_the_key_the_others_see_it_held_then_all_reuse_its_result(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        n = 100
        conns = await asyncio.gather(*(asyncpg.connect(pg_dsn) for _ in range(n)))
        try:
            go = asyncio.Event()

            async def submit(i: int) -> Any:
                await go.wait()
                (answer,) = await claim(conns[i], f"r{i}", [("k", "t")], owner=f"c{i}", lease=LEASE)
                return answer

            submissions = [asyncio.ensure_future(submit(i)) for i in range(n)]
            go.set()  # all at once, each on its own connection
            answers = await asyncio.gather(*submissions)
            holders = [i for i, answer in enumerate(answers) if isinstance(answer, Mine)]
            assert len(holders) == 1
            (holder,) = holders
            for i, answer in enumerate(answers):
                if i != holder:
                    assert answer == Held(f"c{holder}", f"r{holder}", "t", answer.left)

            # The holder's task runs on a worker, whose completion writes the key's result.
            run = f"r{holder}"
            heard = Heard()
            async with Listener(pg_dsn, [KEY_CHANNEL], on_notify=heard):
                await admitted(conn, run, Task("work", 21, id="t", key="k"))
                token = await leased(conn, run, "t")
                done = End("t", token, SUCCEEDED, '{"answer": 42}', "work")
                assert await complete(conn, run, "w1", [done]) == [True]
                await heard.until("k")

            again = await asyncio.gather(
                *(
                    claim(conns[i], f"r{i}", [("k", "t")], owner=f"c{i}", lease=LEASE)
                    for i in range(n)
                )
            )
            assert again == [[Stored('{"answer": 42}', "work")]] * n
        finally:
            await asyncio.gather(*(c.close() for c in conns))


class TestExpiryAndTakeOver:
    async def test_an_expired_hold_is_taken_over_and_its_old_holder_writes_nothing(
        self, conn: asyncpg.Connection
    ) -> None:
        old = await mine(conn, "k", owner="dead", run="r1", task="a")
        (held,) = await claim(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert isinstance(held, Held)
        await expire(conn, "k")
        new = await mine(conn, "k", owner="c2", run="r2", task="b")
        assert new > old
        assert await renew(conn, "dead", [("k", old)], lease=LEASE) == {"k"}
        assert await finish(conn, "dead", [KeyEnd("k", old, True, '"late"', "x")]) == [False]
        row = await key_row(conn, "k")
        assert (row["owner"], row["run_id"], row["task_id"], row["state"], row["output"]) == (
            "c2", "r2", "b", "claimed", None,
        )  # fmt: skip

    async def test_renew_keeps_a_hold_past_the_lease_it_was_claimed_with(
        self, conn: asyncpg.Connection
    ) -> None:
        (kept,) = await claim(conn, "r1", [("kept", "a")], owner="c1", lease=0)
        (lapsed,) = await claim(conn, "r1", [("lapsed", "b")], owner="c1", lease=0)
        assert isinstance(kept, Mine)
        assert isinstance(lapsed, Mine)
        # Both leases ran out as they were taken (zero seconds); only one is renewed.
        assert await renew(conn, "c1", [("kept", kept.token)], lease=LEASE) == set()
        answers = await claim(conn, "r2", [("kept", "x"), ("lapsed", "y")], owner="c2", lease=LEASE)
        assert isinstance(answers[0], Held)
        assert answers[0].left > LEASE / 2
        assert isinstance(answers[1], Mine)

    async def test_a_renewal_with_a_stale_token_or_another_owner_is_refused(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1")
        await expire(conn, "k")
        assert await renew(conn, "c1", [("k", token - 1)], lease=LEASE) == {"k"}
        assert await renew(conn, "c2", [("k", token)], lease=LEASE) == {"k"}
        (answer,) = await claim(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert isinstance(answer, Mine)  # neither renewal kept it alive

    async def test_a_runs_coordinator_renews_all_its_holds_and_only_those(
        self, conn: asyncpg.Connection
    ) -> None:
        for key in ("k", "j", "taken", "done"):
            await claim(conn, "r1", [(key, key)], owner="c1", lease=0)
        await mine(conn, "other", owner="c1", run="r2", task="o")  # the same process, another run
        await expire(conn, "other")
        await mine(conn, "taken", owner="c2", run="r3", task="x")  # (its lease had run out)
        token = (await key_row(conn, "done"))["token"]
        await finish(conn, "c1", [KeyEnd("done", token, True, "1", "a")])
        assert await renew_run(conn, "r1", "c1", lease=LEASE) == 2
        answers = await claim(
            conn, "r4", [("k", "a"), ("j", "b"), ("other", "c")], owner="c4", lease=LEASE
        )
        assert [type(answer) for answer in answers] == [Held, Held, Mine]

    async def test_a_finished_key_is_no_longer_renewed(self, conn: asyncpg.Connection) -> None:
        token = await mine(conn, "k")
        await finish(conn, "c1", [KeyEnd("k", token, True, "1", "a")])
        assert await renew(conn, "c1", [("k", token)], lease=LEASE) == {"k"}


class TestFailedKeys:
    async def test_a_key_whose_holder_failed_is_taken_over_by_the_next_claimer(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        assert await finish(conn, "c1", [KeyEnd("k", token, False, error="failed: no")]) == [True]
        assert (await key_row(conn, "k"))["error"] == "failed: no"
        await mine(conn, "k", owner="c2", run="r2", task="b")
        row = await key_row(conn, "k")
        assert (row["owner"], row["task_id"], row["state"], row["error"]) == (
            "c2", "b", "claimed", None,
        )  # fmt: skip

    async def test_a_failed_completion_fails_its_key_for_the_next_claimer(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"))
        await mine(conn, "k", run="r1", task="a")
        token = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", token, FAILED, error="boom", error_type="E")])
        row = await key_row(conn, "k")
        assert (row["state"], row["error"], row["output"]) == ("failed", "failed: boom", None)
        await mine(conn, "k", owner="c2", run="r2", task="b")

    async def test_a_keyed_task_skipped_with_a_completion_fails_its_key(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(
            conn, "r1", Task("work", 1, id="a"), Task("work", 2, id="b", key="k", depends_on=["a"])
        )
        await mine(conn, "k", run="r1", task="b")
        token = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", token, CANCELLED)])
        row = await key_row(conn, "k")
        assert (row["state"], row["error"]) == ("failed", f"{SKIPPED}: dependency 'a' cancelled")

    async def test_a_keyed_task_lost_too_often_fails_its_key(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"))
        await mine(conn, "k", run="r1", task="a")
        for _ in range(MAX_LOST):
            await leased(conn, "r1", "a")
            await conn.execute(
                "UPDATE orchestra.tasks SET lease_expires = now() - interval '1 second'"
            )
            await take_back_expired(conn)
        row = await key_row(conn, "k")
        assert row["state"] == "failed"
        assert row["error"].startswith(f"{FAILED}: its lease expired {MAX_LOST} times")


class TestCompletion:
    async def test_a_keyed_tasks_success_is_stored_in_its_key_with_its_completion(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"), Task("work", 2, id="b"))
        await mine(conn, "k", owner="coordinator", run="r1", task="a")
        claimed = await claim_tasks(conn, "r1", {"work": 2}, owner="w1", lease=LEASE)
        ends = [
            End(task.id, task.token, SUCCEEDED, f'{{"n": {task.payload}}}', "work")
            for task in claimed
        ]
        written = await complete(conn, "r1", "w1", ends)
        assert written == [True, True]
        row = await key_row(conn, "k")
        assert (row["state"], row["output"], row["agent"], row["owner"]) == (
            "succeeded", '{"n": 1}', "work", "coordinator",
        )  # fmt: skip
        assert await claim(conn, "r2", [("k", "x")], owner="c2", lease=LEASE) == [
            Stored('{"n": 1}', "work")
        ]

    async def test_a_completion_refused_for_a_stale_lease_writes_no_key(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"))
        await mine(conn, "k", run="r1", task="a")
        paused = await leased(conn, "r1", "a", owner="w1")
        await conn.execute("UPDATE orchestra.tasks SET lease_expires = now() - interval '1 s'")
        await take_back_expired(conn)
        fresh = await leased(conn, "r1", "a", owner="w2")
        late = await complete(conn, "r1", "w1", [End("a", paused, SUCCEEDED, '"late"', "work")])
        assert late == [False]
        row = await key_row(conn, "k")
        assert (row["state"], row["output"]) == ("claimed", None)
        await complete(conn, "r1", "w2", [End("a", fresh, SUCCEEDED, '"fresh"', "work")])
        row = await key_row(conn, "k")
        assert (row["state"], row["output"]) == ("succeeded", '"fresh"')

    async def test_a_key_taken_over_by_another_task_is_not_written_by_its_old_holders_end(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"))
        await mine(conn, "k", owner="c1", run="r1", task="a")
        token = await leased(conn, "r1", "a")
        await expire(conn, "k")
        await mine(conn, "k", owner="c2", run="r2", task="b")
        assert await complete(conn, "r1", "w1", [End("a", token, SUCCEEDED, "1", "work")]) == [True]
        row = await key_row(conn, "k")
        assert (row["run_id"], row["task_id"], row["state"]) == ("r2", "b", "claimed")

    async def test_a_completion_waits_for_nothing_but_its_own_key(
        self, conn: asyncpg.Connection
    ) -> None:
        # A task whose key another run holds (its run should have held it back) ends without
        # touching that key; a task without a key writes no key at all.
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"), Task("work", 2, id="b"))
        await mine(conn, "k", owner="c0", run="r0", task="z")
        claimed = await claim_tasks(conn, "r1", {"work": 2}, owner="w1", lease=LEASE)
        ends = [End(task.id, task.token, SUCCEEDED, "1", "work") for task in claimed]
        assert await complete(conn, "r1", "w1", ends) == [True, True]
        assert await conn.fetchval("SELECT count(*) FROM orchestra.keys") == 1
        assert (await key_row(conn, "k"))["state"] == "claimed"


class TestManyRunsSharingKeys:
    async def test_each_key_runs_once_per_failure_and_every_run_ends_with_its_result(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        # 40 runs admit tasks with the same 5 keys at once, each in its own order, as their
        # coordinators would (admission and `admit_keys` in one transaction). A worker runs what
        # the database lets it claim; the first execution of k0 fails. Every coordinator waits
        # for its held keys (`Waiting`, fed by one listener on the key channel) and asks again.
        runs, keys = 40, [f"k{j}" for j in range(5)]
        rng = random.Random(7)
        conns = await asyncio.gather(*(asyncpg.connect(pg_dsn) for _ in range(runs)))
        executed: list[str] = []
        waiting = [Waiting() for _ in range(runs)]
        woken = asyncio.Event()

        def heard(channel: str, payload: str) -> None:
            hits = [w.heard(channel, payload) for w in waiting]  # every waiter hears it
            if any(hits):
                woken.set()

        async def coordinator(i: int) -> dict[str, Any]:
            order = rng.sample(keys, len(keys))
            tasks = [Task("work", key, id=f"t-{key}", key=key) for key in order]
            return await admitted_with_keys(conns[i], f"r{i}", *tasks, owner=f"c{i}")

        try:
            async with Listener(pg_dsn, [KEY_CHANNEL], on_notify=heard):
                answers = await asyncio.gather(*(coordinator(i) for i in range(runs)))
                for key in keys:
                    holders = [i for i in range(runs) if isinstance(answers[i][f"t-{key}"], Mine)]
                    assert len(holders) == 1, key
                for i in range(runs):
                    for task_id, answer in answers[i].items():
                        if isinstance(answer, Held):
                            waiting[i].wait(task_id[2:], answer, time.monotonic())
                with anyio.fail_after(60):
                    while True:
                        ran = await self.work(conn, runs, executed)
                        asked = False
                        for i in range(runs):
                            due = waiting[i].due(time.monotonic())
                            if not due:
                                continue
                            asked = True
                            wanted = [(key, f"t-{key}") for key in due]
                            again = await ask_again(
                                conns[i], f"r{i}", wanted, owner=f"c{i}", lease=LEASE
                            )
                            for task_id, answer in again.items():
                                if isinstance(answer, Held):
                                    waiting[i].wait(task_id[2:], answer, time.monotonic())
                        if not (ran or asked):
                            if not any(waiting):
                                break
                            with anyio.move_on_after(0.5):
                                await woken.wait()
                            woken.clear()
        finally:
            await asyncio.gather(*(c.close() for c in conns))
        assert sorted(executed) == sorted([*keys, "k0"])  # k0 failed once, then ran again
        rows = await conn.fetch(
            "SELECT run_id, id, state, output::text FROM orchestra.tasks ORDER BY run_id, id"
        )
        failed = [row for row in rows if row["state"] == FAILED]
        assert len(failed) == 1
        assert failed[0]["id"] == "t-k0"
        succeeded = [row for row in rows if row["state"] == SUCCEEDED]
        assert len(succeeded) == runs * len(keys) - 1
        assert all(row["output"] == f'"{row["id"][2:]}!"' for row in succeeded)

    @staticmethod
    async def work(conn: asyncpg.Connection, runs: int, executed: list[str]) -> bool:
        """One worker's pass over every run: claim what is ready, run it, complete it (k0 fails
        its first execution). True when it ran something."""
        ran = False
        for i in range(runs):
            claimed = await claim_tasks(conn, f"r{i}", {"work": 10}, owner="w", lease=LEASE)
            ends = []
            for task in claimed:
                key = task.id[2:]
                executed.append(key)
                if key == "k0" and executed.count("k0") == 1:
                    ends.append(End(task.id, task.token, FAILED, error="first try"))
                else:
                    ends.append(End(task.id, task.token, SUCCEEDED, f'"{key}!"', "work"))
            if ends:
                ran = True
                assert all(await complete(conn, f"r{i}", "w", ends))
        return ran


class TestConcurrentWriters:
    async def test_claims_renewals_finishes_and_completions_of_shared_keys_never_deadlock(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        # Each step runs inside a transaction of the caller's, where a deadlock is not retried
        # (as in a coordinator's fenced write): every writer of several keys must lock them in
        # one order. 12 processes with runs of their own take, renew and end 8 shared keys in
        # random orders; a worker completes keyed tasks of their runs meanwhile.
        keys = [f"k{j}" for j in range(8)]
        n = 12
        for i in range(n):
            await admitted(
                conn, f"r{i}", *(Task("work", j, id=key, key=key) for j, key in enumerate(keys))
            )
        conns = await asyncio.gather(*(asyncpg.connect(pg_dsn) for _ in range(n + 1)))
        rng = random.Random(3)
        steps = 0

        async def coordinator(i: int) -> None:
            nonlocal steps
            me, run, c = f"c{i}", f"r{i}", conns[i]
            tokens: dict[str, int] = {}
            for _ in range(60):
                mine_now = rng.sample(keys, rng.randint(1, len(keys)))
                action = rng.random()
                async with c.transaction():
                    if action < 0.4:
                        answers = await claim(
                            c, run, [(k, k) for k in mine_now], owner=me, lease=0.05
                        )
                        tokens.update(
                            (k, a.token)
                            for k, a in zip(mine_now, answers, strict=True)
                            if isinstance(a, Mine)
                        )
                    elif action < 0.55:
                        await renew(c, me, list(tokens.items()), lease=LEASE)
                    elif action < 0.65:
                        await renew_run(c, run, me, lease=0.05)
                    elif action < 0.85:
                        ends = [
                            KeyEnd(k, t, rng.random() < 0.3, "1", "a", "no")
                            for k, t in tokens.items()
                        ]
                        rng.shuffle(ends)
                        await finish(c, me, ends)
                        tokens.clear()
                    elif action < 0.95:
                        await release_run(c, run, me)
                    else:
                        tokens = await adopt(c, run, owner=me, lease=0.05)
                steps += 1

        async def worker() -> None:
            c = conns[n]
            for _ in range(n):
                for i in rng.sample(range(n), n):
                    async with c.transaction():
                        claimed = await claim_tasks(c, f"r{i}", {"work": 3}, owner="w", lease=LEASE)
                        ends = [
                            End(t.id, t.token, rng.choice([SUCCEEDED, FAILED]), "1", "work")
                            for t in claimed
                        ]
                        await complete(c, f"r{i}", "w", ends)

        try:
            await asyncio.gather(*(coordinator(i) for i in range(n)), worker())
        finally:
            await asyncio.gather(*(c.close() for c in conns))
        assert steps == n * 60

    async def test_two_runs_completions_each_spawning_the_key_the_other_ends_never_deadlock(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        # Run a ends its hold of X and spawns a task with the key Y, which run b holds; run b ends
        # Y and spawns X, at the same time. Each completion locks both rows (the spawn's key, and
        # its run's hold it ends): in one order, or the two deadlock. In transactions of the
        # caller's: no retry.
        other = await asyncpg.connect(pg_dsn)
        try:
            for i in range(20):
                x, y = f"X{i}", f"Y{i}"
                tokens: dict[str, dict[str, int]] = {}
                for run, key in ((f"a{i}", x), (f"b{i}", y)):
                    await admitted_with_keys(
                        conn, run, Task("work", 0, id="p"), Task("work", 1, id="h", key=key),
                        owner=f"c-{run}",
                    )  # fmt: skip
                    tokens[run] = {
                        t.id: t.token
                        for t in await claim_tasks(conn, run, {"work": 2}, owner="w", lease=LEASE)
                    }

                async def end(
                    c: asyncpg.Connection, run: str, spawn_key: str, held: dict[str, int]
                ) -> None:
                    async with c.transaction():
                        await complete(
                            c, run, "w",
                            [End("h", held["h"], SUCCEEDED, '"h"', "work"),
                             End("p", held["p"], SUCCEEDED, '"p"', "work")],
                            spawned={"p": [Task("work", 2, id="p.c", key=spawn_key)]},
                            admission=Admission(("work",), {}), key_lease=LEASE,
                        )  # fmt: skip

                await asyncio.gather(
                    end(conn, f"a{i}", y, tokens[f"a{i}"]), end(other, f"b{i}", x, tokens[f"b{i}"])
                )
                for run, key in ((f"a{i}", x), (f"b{i}", y)):
                    assert (await key_row(conn, key))["state"] == "succeeded"
                    assert (await states(conn, run))["p.c"] in ("succeeded", "pending")
        finally:
            await other.close()

    async def test_a_claim_of_the_run_while_a_completion_locks_its_keys_never_deadlocks(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        # A completion locks its run's holds in key order, then writes their ends in a statement
        # of a newer snapshot. Its run takes one more key over (another run's hold ran out) while
        # the completion waits for a later key: the write must not take that row too (locking it
        # then, out of order, behind a writer of the run's holds that has it and waits for a key
        # the completion holds). Each runs in a transaction of the caller's: no retry.
        await admitted(conn, "r1", *(Task("work", j, id=k, key=k) for j, k in enumerate("ace")))
        await mine(conn, "a", owner="c2", run="r2", task="a")
        await expire(conn, "a")
        await mine(conn, "c", owner="c1", run="r1", task="c")
        await mine(conn, "e", owner="c1", run="r1", task="e")
        claimed = await claim_tasks(conn, "r1", {"work": 3}, owner="w1", lease=LEASE)
        ends = [End(t.id, t.token, SUCCEEDED, '"out"', "work") for t in claimed]
        assert sorted(e.id for e in ends) == ["a", "c", "e"]
        worker, writer, blocker = [await asyncpg.connect(pg_dsn) for _ in range(3)]

        async def completes() -> list[bool]:
            async with worker.transaction():
                return await complete(worker, "r1", "w1", ends)

        async def renews() -> int:
            async with writer.transaction():
                return await renew_run(writer, "r1", "c1", lease=LEASE)

        try:
            stuck = blocker.transaction()
            await stuck.start()
            await blocker.execute("SELECT FROM orchestra.keys WHERE key = 'e' FOR UPDATE")
            completion = asyncio.ensure_future(completes())
            await waits_for_a_lock(conn, worker, completion)  # for "e", with "c" locked
            await mine(conn, "a", owner="c1", run="r1", task="a")  # taken over meanwhile
            renewal = asyncio.ensure_future(renews())  # r1's holds in key order
            await waits_for_a_lock(conn, writer, renewal)
            await stuck.rollback()
            done = await asyncio.gather(completion, renewal, return_exceptions=True)
        finally:
            for other in (worker, writer, blocker):
                await other.close()
        assert list(done) == [[True, True, True], 1]  # "a": "c" and "e" ended before it held them
        assert [(await key_row(conn, k))["state"] for k in "ace"] == [
            "claimed",
            "succeeded",
            "succeeded",
        ]  # "a" was another run's when the completion ended its task: r1 holds it now

    async def test_leases_taken_back_in_two_runs_and_a_key_asked_for_again_never_deadlock(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        # Taking leases back ends the tasks lost too often of several runs in one transaction:
        # were the keys of the first run's locked before the second run's tasks are settled, it
        # would hold r1's key "k" while waiting for r2's task "b", which a coordinator asking for
        # "k" again has locked (a claim locks its tasks first, then their keys).
        await admitted_with_keys(conn, "r1", Task("work", 1, id="a", key="k"), owner="c1")
        answers = await admitted_with_keys(
            conn, "r2", Task("work", 1, id="y"), Task("work", 2, id="b", key="k", depends_on=["y"])
        )
        assert isinstance(answers["b"], Held)  # held back for r1's "a"
        await leased(conn, "r1", "a")
        await leased(conn, "r2", "y")
        await conn.execute(  # lost once more, each fails: r1's first
            "UPDATE orchestra.tasks SET lost = $1, lease_expires = now() - "
            "CASE run_id WHEN 'r1' THEN interval '2 seconds' ELSE interval '1 second' END "
            "WHERE lease_owner IS NOT NULL",
            MAX_LOST - 1,
        )
        taker, asker = [await asyncpg.connect(pg_dsn) for _ in range(2)]

        async def takes_back() -> list[tuple[str, str]]:
            async with taker.transaction():  # a deadlock here is not retried
                return [(t.run_id, t.id) for t in await take_back_expired(taker)]

        try:
            async with asker.transaction():  # a coordinator's fenced write: not retried either
                await asker.execute(  # `ask_again` locks its tasks first
                    "SELECT FROM orchestra.tasks WHERE run_id = 'r2' AND id = 'b' FOR UPDATE"
                )
                taking = asyncio.ensure_future(takes_back())
                await waits_for_a_lock(conn, taker, taking)  # for "b", to skip it
                again = await ask_again(asker, "r2", [("k", "b")], owner="c2", lease=LEASE)
            taken = await taking
        finally:
            for other in (taker, asker):
                await other.close()
        assert isinstance(again["b"], Held)  # "a" had not ended yet when "k" was asked for
        assert taken == [("r1", "a"), ("r2", "y")]
        assert await states(conn, "r2") == {"y": FAILED, "b": SKIPPED}
        assert (await key_row(conn, "k"))["state"] == "failed"


async def waits_for_a_lock(
    conn: asyncpg.Connection, other: asyncpg.Connection, step: asyncio.Future[Any]
) -> None:
    """Wait until `other`, running `step`, waits for a lock."""
    pid = other.get_server_pid()
    for _ in range(500):
        assert not step.done(), step
        waiting = await conn.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the other connection did not wait for a lock")


class TestAKeySharedInItsRun:
    """The tasks of a run that share a key are one piece of work: one holds the key, the others
    follow it, and one of them takes it over when it does not succeed (the run's graph decides
    which). The key's row is the run's hold: whichever of them ends the work ends the key."""

    @staticmethod
    async def follower(conn: asyncpg.Connection, run: str, task_id: str) -> None:
        """`task_id` waits in its run as a follower does (never ready while its holder lives)."""
        await conn.execute(
            "UPDATE orchestra.tasks SET state = 'pending', waiting = 1 "
            "WHERE run_id = $1 AND id = $2",
            run, task_id,
        )  # fmt: skip

    @staticmethod
    async def takes_over(conn: asyncpg.Connection, run: str, task_id: str) -> None:
        """`task_id` took the key over in its run: ready (whatever the graph made of it)."""
        await conn.execute(
            "UPDATE orchestra.tasks SET state = 'ready', waiting = 0 "
            "WHERE run_id = $1 AND id = $2 AND state IN ('pending', 'ready')",
            run, task_id,
        )  # fmt: skip

    async def test_a_holder_that_fails_leaves_the_key_to_the_task_of_its_run_that_takes_over(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(
            conn, "r1", Task("work", 1, id="a", key="k"), Task("work", 2, id="b", key="k")
        )
        await self.follower(conn, "r1", "b")
        await mine(conn, "k", run="r1", task="a")
        a = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", a, FAILED, error="no")])
        assert (await key_row(conn, "k"))["state"] == "claimed"  # not another run's to take
        (answer,) = await claim(conn, "r2", [("k", "x")], owner="c2", lease=LEASE)
        assert isinstance(answer, Held)
        await self.takes_over(conn, "r1", "b")
        b = await leased(conn, "r1", "b")
        await complete(conn, "r1", "w1", [End("b", b, SUCCEEDED, '"by b"', "work")])
        assert await claim(conn, "r2", [("k", "x")], owner="c2", lease=LEASE) == [
            Stored('"by b"', "work")
        ]

    async def test_the_key_fails_once_no_task_of_its_run_is_left_to_run_it(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(
            conn, "r1", Task("work", 1, id="a", key="k"), Task("work", 2, id="b", key="k")
        )
        await self.follower(conn, "r1", "b")
        await mine(conn, "k", run="r1", task="a")
        a = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", a, FAILED, error="no")])
        await self.takes_over(conn, "r1", "b")
        b = await leased(conn, "r1", "b")
        await complete(conn, "r1", "w1", [End("b", b, FAILED, error="no again")])
        row = await key_row(conn, "k")
        assert (row["state"], row["error"]) == ("failed", "failed: no again")

    async def test_a_success_and_a_failure_of_one_key_in_one_completion_store_the_success(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(
            conn, "r1", Task("work", 1, id="a", key="k"), Task("work", 2, id="b", key="k")
        )
        await mine(conn, "k", run="r1", task="a")
        # b follows a in the run's graph: made ready by hand, so that both end in one completion.
        await self.takes_over(conn, "r1", "b")
        claimed = await claim_tasks(conn, "r1", {"work": 2}, owner="w1", lease=LEASE)
        tokens = {task.id: task.token for task in claimed}
        ends = [
            End("a", tokens["a"], FAILED, error="no"),
            End("b", tokens["b"], SUCCEEDED, "2", "work"),
        ]
        assert await complete(conn, "r1", "w1", ends) == [True, True]
        row = await key_row(conn, "k")
        assert (row["state"], row["output"]) == ("succeeded", "2")


class TestAStoppedRun:
    async def test_lets_go_of_its_holds_but_those_of_tasks_a_worker_runs(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        await admitted_with_keys(
            conn, "r1", Task("work", 1, id="a", key="ka"), Task("work", 2, id="b", key="kb"),
            Task("work", 3, id="c", key="kc"), owner="c1",
        )  # fmt: skip
        await mine(conn, "elsewhere", owner="c1", run="r2", task="e")
        claimed = await claim_tasks(conn, "r1", {"work": 2}, owner="w1", lease=LEASE)
        assert [task.id for task in claimed] == ["a", "b"]
        b = claimed[1].token
        await complete(conn, "r1", "w1", [End("b", b, SUCCEEDED, "2", "work")])
        heard = Heard()
        async with Listener(pg_dsn, [KEY_CHANNEL], on_notify=heard):
            assert await release_run(conn, "r1", "c1") == ["kc"]
            await heard.until("kc")
        states_of = {
            key: (await key_row(conn, key))["state"] for key in ("ka", "kb", "kc", "elsewhere")
        }
        assert states_of == {
            "ka": "claimed", "kb": "succeeded", "kc": "failed", "elsewhere": "claimed"
        }  # fmt: skip
        assert (await key_row(conn, "kc"))["error"] == "released: its run ended first"
        # The resumed run claims it again.
        assert isinstance(
            (await claim(conn, "r1", [("kc", "c")], owner="c1b", lease=LEASE))[0], Mine
        )


class TestAnnouncements:
    async def test_every_finish_is_heard_on_the_key_channel_once_committed(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        heard = Heard()
        async with Listener(pg_dsn, [KEY_CHANNEL], on_notify=heard):
            token = await mine(conn, "direct")
            async with conn.transaction():
                await finish(conn, "c1", [KeyEnd("direct", token, False, error="no")])
                assert heard.payloads == []  # (a notification is delivered at commit)
            await heard.until("direct")
            await admitted(conn, "r1", Task("work", 1, id="a", key="completed"))
            await mine(conn, "completed", run="r1", task="a")
            task = await leased(conn, "r1", "a")
            await complete(conn, "r1", "w1", [End("a", task, SUCCEEDED, "1", "work")])
            await heard.until("completed")

    async def test_a_long_key_is_announced_as_the_digest_signal_of_makes(
        self, conn: asyncpg.Connection, pg_dsn: str
    ) -> None:
        key = "é" * 150  # 300 bytes
        heard = Heard()
        async with Listener(pg_dsn, [KEY_CHANNEL], on_notify=heard):
            token = await mine(conn, key)
            await finish(conn, "c1", [KeyEnd(key, token, True, "1", "a")])
            await heard.until(signal_of(key))
        assert signal_of(key).startswith("#")
        assert signal_of(key) != signal_of(key + "x")
        assert signal_of("short") == "short"


class TestWaiting:
    def test_a_key_is_due_when_its_finish_is_heard(self) -> None:
        waiting = Waiting()
        waiting.wait("k", Held("c", "r", "t", 30.0), now=100.0)
        waiting.wait("j", Held("c", "r", "u", 30.0), now=100.0)
        assert waiting.due(101.0) == []
        assert not waiting.heard(KEY_CHANNEL, "other")
        assert waiting.heard(KEY_CHANNEL, "k")
        assert waiting.due(101.0) == ["k"]
        assert "k" not in waiting
        assert len(waiting) == 1

    def test_a_key_is_due_when_its_holders_lease_runs_out_unheard(self) -> None:
        waiting = Waiting()
        waiting.wait("k", Held("c", "r", "t", 5.0), now=100.0)
        waiting.wait("j", Held("c", "r", "u", 9.0), now=100.0)
        assert waiting.next_look() == 105.0
        assert waiting.due(104.9) == []
        assert waiting.due(105.0) == ["k"]
        assert waiting.next_look() == 109.0

    def test_a_key_forgotten_or_waited_for_again_is_not_due_from_an_old_announcement(
        self,
    ) -> None:
        waiting = Waiting()
        waiting.wait("k", Held("c", "r", "t", 5.0), now=0.0)
        waiting.heard(KEY_CHANNEL, "k")
        waiting.wait("k", Held("c2", "r2", "t2", 5.0), now=1.0)  # asked again: held anew
        assert waiting.due(2.0) == []
        waiting.forget("k")
        assert waiting.due(100.0) == []
        assert waiting.next_look() == float("inf")
        assert not waiting.heard(KEY_CHANNEL, "k")

    def test_every_key_is_due_when_the_listener_comes_back(self) -> None:
        waiting = Waiting()
        waiting.wait("k", Held("c", "r", "t", 30.0), now=0.0)
        waiting.wait("j", Held("c", "r", "u", 30.0), now=0.0)
        waiting.hear_all()
        assert sorted(waiting.due(1.0)) == ["j", "k"]

    def test_a_key_whose_finish_was_announced_just_before_its_wait_is_due_at_once(self) -> None:
        # The database answered "held", then the holder finished and announced it before the
        # answer was waited for: without the announcement remembered, the key would wait out
        # the holder's lease.
        waiting = Waiting()
        assert not waiting.heard(KEY_CHANNEL, "k", 10.0)
        waiting.wait("k", Held("c", "r", "t", 30.0), now=10.5)
        assert waiting.due(10.5) == ["k"]
        # Remembered once: asked again and still held, it waits.
        waiting.wait("k", Held("c", "r", "t", 30.0), now=10.6)
        assert waiting.due(11.0) == []

    def test_an_announcement_older_than_recent_makes_nothing_due(self) -> None:
        waiting = Waiting()
        waiting.heard(KEY_CHANNEL, "k", 0.0)
        waiting.heard(KEY_CHANNEL, "j", 0.1)
        waiting.wait("k", Held("c", "r", "t", 30.0), now=RECENT + 1.0)
        assert waiting.due(RECENT + 1.0) == []
        # What is remembered is let go of as newer announcements come.
        for i in range(3):
            waiting.heard(KEY_CHANNEL, f"x{i}", RECENT + 2.0 + i)
        waiting.wait("j", Held("c", "r", "u", 30.0), now=RECENT + 1.0)
        assert waiting.due(RECENT + 1.0) == []
        assert waiting._recent.keys() == {"x0", "x1", "x2"}

    def test_keys_of_one_digest_are_all_woken_by_it(self) -> None:
        waiting = Waiting()
        long = "x" * 300
        waiting.wait(long, Held("c", "r", "t", 5.0), now=0.0)
        assert waiting.heard(KEY_CHANNEL, signal_of(long))
        assert waiting.due(0.0) == [long]


async def states(conn: asyncpg.Connection, run: str) -> dict[str, str]:
    rows = await conn.fetch("SELECT id, state FROM orchestra.tasks WHERE run_id = $1", run)
    return {row[0]: row[1] for row in rows}


async def admitted_with_keys(
    conn: asyncpg.Connection, run: str, *tasks: Task, owner: str = "c2"
) -> dict[str, Any]:
    """Admit `tasks` into `run` and claim their keys in the same transaction, as a coordinator
    does: the answers by task id."""

    async def step(conn: asyncpg.Connection) -> dict[str, Any]:
        await admitted(conn, run, *tasks)
        wanted = [(task.key, task.id) for task in tasks if task.key is not None]
        return await admit_keys(conn, run, wanted, owner=owner, lease=LEASE)

    answers: dict[str, Any] = await transaction(conn, step)
    return answers


class TestARunsKeyedTasks:
    async def test_a_task_whose_key_another_run_holds_is_held_back_until_the_key_is_its(
        self, conn: asyncpg.Connection
    ) -> None:
        await mine(conn, "k", owner="c1", run="r1", task="a")
        answers = await admitted_with_keys(conn, "r2", Task("work", 1, id="b", key="k"))
        assert isinstance(answers["b"], Held)
        assert await states(conn, "r2") == {"b": "pending"}
        assert await claim_tasks(conn, "r2", {"work": 10}, owner="w", lease=LEASE) == []
        assert await held_back(conn, "r2") == [("k", "b")]
        # Asked again while the holder lives: still held back.
        assert isinstance(
            (await ask_again(conn, "r2", [("k", "b")], owner="c2", lease=LEASE))["b"], Held
        )
        assert await states(conn, "r2") == {"b": "pending"}
        # The holder fails: the key is b's, and b is ready.
        token = (await key_row(conn, "k"))["token"]
        await finish(conn, "c1", [KeyEnd("k", token, False, error="failed: no")])
        answers = await ask_again(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert isinstance(answers["b"], Mine)
        assert await states(conn, "r2") == {"b": "ready"}
        assert await held_back(conn, "r2") == []
        assert (await key_row(conn, "k"))["task_id"] == "b"

    async def test_a_held_task_ends_with_the_holders_success_unexecuted_and_frees_its_dependents(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r1", Task("work", 1, id="a", key="k"))
        await mine(conn, "k", owner="c1", run="r1", task="a")
        await admitted_with_keys(
            conn, "r2", Task("work", 1, id="b", key="k"), Task("work", 2, id="c", depends_on=["b"])
        )
        token = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", token, SUCCEEDED, '{"v": 1}', "work")])
        answers = await ask_again(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert answers == {"b": Stored('{"v": 1}', "work")}
        row = await conn.fetchrow(
            "SELECT state, output::text, agent, attempts FROM orchestra.tasks "
            "WHERE run_id = 'r2' AND id = 'b'"
        )
        assert tuple(row) == ("succeeded", '{"v": 1}', "work", 0)  # type: ignore[arg-type]
        assert await states(conn, "r2") == {"b": "succeeded", "c": "ready"}

    async def test_a_task_whose_key_succeeded_before_ends_at_admission_with_its_result(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await finish(conn, "c1", [KeyEnd("k", token, True, '"done"', "work")])
        answers = await admitted_with_keys(
            conn, "r2", Task("work", 1, id="b", key="k"), Task("work", 2, id="c", depends_on=["b"])
        )
        assert answers == {"b": Stored('"done"', "work")}
        assert await states(conn, "r2") == {"b": "succeeded", "c": "ready"}

    async def test_a_held_task_that_waits_for_a_dependency_too_is_ready_only_once_both_are_done(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await admitted_with_keys(
            conn, "r2", Task("work", 1, id="d"), Task("work", 2, id="b", key="k", depends_on=["d"])
        )
        await finish(conn, "c1", [KeyEnd("k", token, False, error="failed: no")])
        await ask_again(conn, "r2", [("k", "b")], owner="c2", lease=LEASE)
        assert await states(conn, "r2") == {"d": "ready", "b": "pending"}
        d = await leased(conn, "r2", "d")
        await complete(conn, "r2", "w1", [End("d", d, SUCCEEDED, "1", "work")])
        assert (await states(conn, "r2"))["b"] == "ready"

    async def test_a_task_holding_its_key_runs_as_admitted_and_its_end_is_the_keys(
        self, conn: asyncpg.Connection
    ) -> None:
        answers = await admitted_with_keys(conn, "r1", Task("work", 1, id="a", key="k"))
        assert isinstance(answers["a"], Mine)
        token = await leased(conn, "r1", "a")
        await complete(conn, "r1", "w1", [End("a", token, SUCCEEDED, "7", "work")])
        assert await claim(conn, "r9", [("k", "z")], owner="c9", lease=LEASE) == [
            Stored("7", "work")
        ]

    async def test_a_held_task_that_ended_meanwhile_is_passed_over(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await admitted_with_keys(
            conn, "r2", Task("work", 1, id="d"), Task("work", 2, id="b", key="k", depends_on=["d"])
        )
        d = await leased(conn, "r2", "d")
        await complete(conn, "r2", "w1", [End("d", d, FAILED, error="no")])
        assert (await states(conn, "r2"))["b"] == SKIPPED
        await finish(conn, "c1", [KeyEnd("k", token, False, error="failed: no")])
        assert await ask_again(conn, "r2", [("k", "b")], owner="c2", lease=LEASE) == {}
        assert (await key_row(conn, "k"))["state"] == "failed"  # nobody took it
        assert await held_back(conn, "r2") == []


async def spawned(
    conn: asyncpg.Connection, run: str, spawner: str, *tasks: Task, key_lease: float | None = LEASE
) -> None:
    """Lease `spawner` (ready in `run`) to the worker "w1" and complete it, its attempt having
    spawned `tasks` (its key holds for `key_lease` seconds: None, decided within the run only)."""
    token = await leased(conn, run, spawner)
    (written,) = await complete(
        conn, run, "w1", [End(spawner, token, SUCCEEDED, '"split"', "work")],
        spawned={spawner: list(tasks)}, admission=Admission(("work",), {}), key_lease=key_lease,
    )  # fmt: skip
    assert written


class TestSpawnedKeys:
    """A spawn's key decided across runs in the completion that admits it (`admit_spawned`), and
    read back by the run's coordinator (`spawn_answers`)."""

    async def test_a_new_key_is_held_for_the_runs_coordinator_and_the_spawn_runs(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r", Task("work", 0, id="p"))
        assert await acquire(conn, "r", owner="coord", lease=LEASE) is not None
        await spawned(conn, "r", "p", Task("work", 1, id="p.c", key="k"))
        row = await key_row(conn, "k")
        # The coordinator's, not the worker's: the coordinator renews its run's holds.
        assert (row["owner"], row["run_id"], row["task_id"], row["state"]) == (
            "coord",
            "r",
            "p.c",
            "claimed",
        )
        assert (await states(conn, "r"))["p.c"] == "ready"
        assert await spawn_answers(conn, "r", ["p"]) == {}  # it holds its key: nothing to do
        assert await renew_run(conn, "r", "coord", lease=LEASE) == 1
        token = await leased(conn, "r", "p.c")
        await complete(conn, "r", "w1", [End("p.c", token, SUCCEEDED, '"paid"', "work")])
        assert await claim(conn, "r9", [("k", "z")], owner="c9", lease=LEASE) == [
            Stored('"paid"', "work")
        ]

    async def test_with_no_coordinator_the_hold_is_the_completing_process(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r", Task("work", 0, id="p"))
        await spawned(conn, "r", "p", Task("work", 1, id="p.c", key="k"))
        assert (await key_row(conn, "k"))["owner"] == "w1"

    async def test_a_key_stored_before_ends_the_spawn_and_readies_what_waits_for_it(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await finish(conn, "c1", [KeyEnd("k", token, True, '"done"', "x")])
        await admitted(conn, "r", Task("work", 0, id="p"))
        await spawned(
            conn, "r", "p", Task("work", 1, id="p.c", key="k"),
            Task("work", 2, id="p.d", depends_on=["p.c"]),
        )  # fmt: skip
        assert await states(conn, "r") == {"p": "succeeded", "p.c": "succeeded", "p.d": "ready"}
        assert await spawn_answers(conn, "r", ["p"]) == {"p.c": Stored('"done"', "x")}
        assert (await key_row(conn, "k"))["run_id"] == "r1"

    async def test_a_key_another_run_holds_holds_the_spawn_back_until_asked_again(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await admitted(conn, "r", Task("work", 0, id="p"))
        assert await acquire(conn, "r", owner="coord", lease=LEASE) is not None
        await spawned(conn, "r", "p", Task("work", 1, id="p.c", key="k"))
        assert (await states(conn, "r"))["p.c"] == "pending"
        assert await claim_tasks(conn, "r", {"work": 10}, owner="w", lease=LEASE) == []
        assert await held_back(conn, "r") == [("k", "p.c")]
        (answer,) = (await spawn_answers(conn, "r", ["p"])).values()
        assert isinstance(answer, Held)
        assert (answer.owner, answer.run_id, answer.task_id) == ("c1", "r1", "a")
        assert 0 < answer.left <= LEASE
        # Its holder done with it: asked for again at once (its announcement may be gone).
        await finish(conn, "c1", [KeyEnd("k", token, True, '"done"', "x")])
        (answer,) = (await spawn_answers(conn, "r", ["p"])).values()
        assert isinstance(answer, Held)
        assert answer.left == 0
        assert await ask_again(conn, "r", [("k", "p.c")], owner="coord", lease=LEASE) == {
            "p.c": Stored('"done"', "x")
        }
        assert (await states(conn, "r"))["p.c"] == "succeeded"
        assert await spawn_answers(conn, "r", ["p"]) == {"p.c": Stored('"done"', "x")}

    async def test_a_spawn_following_a_task_of_its_run_claims_nothing(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r", Task("work", 0, id="p"), Task("work", 9, id="h", key="k"))
        await spawned(conn, "r", "p", Task("work", 1, id="p.c", key="k"))
        assert await conn.fetchval("SELECT count(*) FROM orchestra.keys") == 0
        assert await spawn_answers(conn, "r", ["p"]) == {}

    async def test_without_a_key_lease_a_spawns_key_is_decided_within_its_run_only(
        self, conn: asyncpg.Connection
    ) -> None:
        token = await mine(conn, "k", owner="c1", run="r1", task="a")
        await finish(conn, "c1", [KeyEnd("k", token, True, '"done"', "x")])
        await admitted(conn, "r", Task("work", 0, id="p"))
        await spawned(conn, "r", "p", Task("work", 1, id="p.c", key="k"), key_lease=None)
        assert (await states(conn, "r"))["p.c"] == "ready"

    async def test_admit_spawned_passes_over_spawns_that_hold_no_key(
        self, conn: asyncpg.Connection
    ) -> None:
        await admitted(conn, "r", Task("work", 0, id="p"))
        await admit_spawned(conn, "r", ["p"], [], owner="w", lease=LEASE)
        assert await conn.fetchval("SELECT count(*) FROM orchestra.keys") == 0


class SQLiteKeys:
    """The model: the SQLite store's key claims (`_writes.claim_keys`) and key writes
    (`_writes.write`), on a file of its own, driven with the same steps."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        sqlite_migrate(self.conn, str(path))

    def claim(self, owner: str, run: str, task: str, key: str) -> tuple[str, Any, Any]:
        (answer,) = sqlite_writes.claim_keys(
            self.conn, owner, run, [(key, task)], time.time(), LEASE
        )
        return answer

    def finish(self, owner: str, key: str, output: str | None) -> None:
        keys: tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], None]
        if output is not None:
            keys = ([(output, "agent", key, owner)], [], None)
        else:
            keys = ([], [("failed: no", time.time(), key, owner)], None)
        sqlite_writes.write(self.conn, "model", ([], []), ([], []), [], [], keys=keys)

    def expire(self, key: str) -> None:
        self.conn.execute("UPDATE keys SET heartbeat = 0 WHERE key = ?", (key,))

    def owner(self, key: str) -> str | None:
        row = self.conn.execute("SELECT owner FROM keys WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def rows(self) -> dict[str, tuple[Any, ...]]:
        rows = self.conn.execute("SELECT key, run_id, task_id, state, output, agent FROM keys")
        return {row[0]: tuple(row[1:]) for row in rows}


def as_sqlite(answer: Any) -> tuple[str, Any, Any]:
    """A PostgreSQL answer in the words of SQLite's."""
    if isinstance(answer, Mine):
        return ("mine", None, None)
    if isinstance(answer, Stored):
        return ("done", answer.output, answer.agent)
    return ("wait", answer.run_id, answer.task_id)


class TestModel:
    @pytest.mark.parametrize("seed", range(4))
    async def test_claims_finishes_and_expiries_answer_as_the_sqlite_stores(
        self, conn: asyncpg.Connection, tmp_path: Path, seed: int
    ) -> None:
        rng = random.Random(seed)
        model = SQLiteKeys(tmp_path / "model.db")
        try:
            await self._play(conn, rng, model)
        finally:
            model.conn.close()

    async def _play(self, conn: asyncpg.Connection, rng: random.Random, model: SQLiteKeys) -> None:
        keys = ["k0", "k1", "k2"]
        submitters = [(f"c{i}", f"r{i}", f"t{i % 2}") for i in range(4)]  # owner, run, task
        holds: dict[str, tuple[str, int]] = {}  # key -> (owner, token) of its live hold
        stale: list[tuple[str, str, int]] = []  # (key, owner, token) of holds taken over
        for step in range(120):
            key = rng.choice(keys)
            action = rng.random()
            if action < 0.5:
                owner, run, task = rng.choice(submitters)
                (answer,) = await claim(conn, run, [(key, task)], owner=owner, lease=LEASE)
                assert as_sqlite(answer) == model.claim(owner, run, task, key), step
                if isinstance(answer, Mine):
                    if key in holds and holds[key][0] != owner:
                        stale.append((key, *holds[key]))
                    holds[key] = (owner, answer.token)
            elif action < 0.75 and key in holds:
                owner, token = holds.pop(key)
                output = f'"{step}"' if rng.random() < 0.6 else None
                end = KeyEnd(key, token, output is not None, output, "agent", "failed: no")
                assert await finish(conn, owner, [end]) == [True]
                model.finish(owner, key, output)
            elif action < 0.85 and stale:
                # A holder whose key another owner took over ends late: refused by both (SQLite
                # fences by owner alone: only while the key's row names another owner).
                key, owner, token = stale.pop(rng.randrange(len(stale)))
                if model.owner(key) == owner:
                    continue
                late = KeyEnd(key, token, True, '"late"', "x")
                assert await finish(conn, owner, [late]) == [False], step
                model.finish(owner, key, '"late"')
            else:
                await expire(conn, key)
                model.expire(key)
            found = await conn.fetch(
                "SELECT key, run_id, task_id, state, output::text, agent FROM orchestra.keys"
            )
            assert {row[0]: tuple(row[1:]) for row in found} == model.rows(), step
