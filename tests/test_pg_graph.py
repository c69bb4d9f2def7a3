"""A run's graph on PostgreSQL (`orchestra.stores._postgres._graph`), on the session's real server:
admission all or nothing with the memory store's checks; settling in the completion's
transaction (dependents made ready, failures skipping what waits, groups, spawns); keys within a
run (a task with the key another task holds follows it); the wake-up sent; two parents completed
at once readying their child once; the coordinator's mirror hearing a worker's ends; and a model
test: the same operations through a `MemoryRun` and through the database end in the same states.

A task is claimed for a test by `take` (its lease written straight into its row): the claim
itself is `_leases`' and its tests'."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestra import InputError, Task
from orchestra._admission import Admission
from orchestra._task import CANCELLED, FAILED, PENDING, SKIPPED, SUCCEEDED
from orchestra.stores import MemoryStore
from orchestra.stores._postgres import _coordinator as coordinator
from orchestra.stores._postgres import _jobs as jobs
from orchestra.stores._postgres._graph import admit
from orchestra.stores._postgres._leases import SERVER_SETTINGS, End, claim, complete, connect
from orchestra.stores._postgres._listen import channel_of
from orchestra.stores._postgres._planner import Growth
from orchestra.stores._postgres._settle import close_input, transaction
from orchestra.stores._protocol import NoListener

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence

    from tests.pg import PgDatabases

pytestmark = [pytest.mark.subprocess, pytest.mark.postgres]

KINDS = ("a", "b")


def admission() -> Admission:
    return Admission(KINDS, {})


@pytest.fixture
async def conn(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a new database with orchestra's schema, and its run ``r``."""
    conn = await asyncpg.connect(pg_dsn)
    await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r')")
    try:
        yield conn
    finally:
        await conn.close()


async def states(conn: asyncpg.Connection, run_id: str = "r") -> dict[str, str]:
    rows = await conn.fetch("SELECT id, state FROM orchestra.tasks WHERE run_id = $1", run_id)
    return {row[0]: row[1] for row in rows}


async def waiting(conn: asyncpg.Connection, task_id: str) -> int:
    found: int = await conn.fetchval("SELECT waiting FROM orchestra.tasks WHERE id = $1", task_id)
    return found


async def take(conn: asyncpg.Connection, task_id: str, owner: str = "w", run: str = "r") -> int:
    """Lease this ready task to `owner` (as a claim would); its token."""
    token: int | None = await conn.fetchval(
        "UPDATE orchestra.tasks SET state = 'claimed', token = nextval('orchestra.lease_tokens'), "
        "attempts = attempts + 1, lease_owner = $3, lease_expires = now() + interval '30 s' "
        "WHERE run_id = $1 AND id = $2 AND state = 'ready' RETURNING token",
        run, task_id, owner,
    )  # fmt: skip
    assert token is not None, f"{task_id} is not ready"
    return token


async def finish(
    conn: asyncpg.Connection,
    task_id: str,
    state: str = SUCCEEDED,
    *,
    spawned: Sequence[Task] = (),
    run: str = "r",
) -> None:
    token = await take(conn, task_id, run=run)
    (written,) = await complete(
        conn, run, "w", [End(task_id, token, state, "1" if state == SUCCEEDED else None)],
        spawned={task_id: spawned}, admission=admission(),
    )  # fmt: skip
    assert written


class TestAdmission:
    async def test_waiting_counts_and_the_tasks_waiting_for_nothing_ready(
        self, conn: asyncpg.Connection
    ) -> None:
        admitted = await admit(
            conn, "r",
            [Task("a", id="c", depends_on=["x", "y"]), Task("a", id="x"),
             Task("b", id="y", depends_on=["x"]), Task("b", id="free")],
            admission=admission(),
        )  # fmt: skip
        assert admitted.ids == ["c", "x", "y", "free"]
        assert admitted.ready == ["x", "free"]
        assert await states(conn) == {"c": "pending", "x": "ready", "y": "pending", "free": "ready"}
        assert [await waiting(conn, t) for t in ("c", "y")] == [2, 1]

    async def test_what_waits_for_nothing_is_written_ready_by_its_insert_each_row_once(
        self, conn: asyncpg.Connection
    ) -> None:
        async with conn.transaction():  # the counts of this transaction's own writes
            admitted = await admit(
                conn, "r", [Task("a", id="x"), Task("b", id="y", depends_on=["x"]),
                            Task("b", id="z")],
                admission=admission(),
            )  # fmt: skip
            written = await conn.fetchrow(
                "SELECT pg_stat_get_xact_tuples_inserted(c.oid), "
                "pg_stat_get_xact_tuples_updated(c.oid) FROM pg_class AS c "
                "WHERE c.oid = 'orchestra.tasks'::regclass"
            )
        assert admitted.ready == ["x", "z"]
        assert await states(conn) == {"x": "ready", "y": "pending", "z": "ready"}
        assert written is not None
        assert (written[0], written[1]) == (3, 0)

    async def test_a_large_batch_leaves_the_connections_plan_cache_mode_as_it_was(
        self, pg_dsn: str
    ) -> None:
        conn = await connect(pg_dsn)  # the store's settings: force_custom_plan
        try:
            await conn.execute("INSERT INTO orchestra.runs (id) VALUES ('r')")
            async with conn.transaction():
                admitted = await admit(
                    conn, "r", [Task("a", i, id=f"t{i}") for i in range(150)],
                    admission=admission(),
                )  # fmt: skip
                mode = await conn.fetchval("SHOW plan_cache_mode")
        finally:
            await conn.close()
        assert len(admitted.ready) == 150
        assert mode == SERVER_SETTINGS["plan_cache_mode"]

    async def test_generated_ids_and_a_batch_of_plain_tasks(self, conn: asyncpg.Connection) -> None:
        admitted = await admit(conn, "r", [Task("a", 1), Task("b", 2)], admission=admission())
        assert admitted.ready == ["a#1", "b#2"]
        row = await conn.fetchrow(
            "SELECT payload::text, named FROM orchestra.tasks WHERE id = 'b#2'"
        )
        assert row is not None
        assert (row[0], row[1]) == ("2", False)

    @pytest.mark.parametrize(
        ("tasks", "task_id", "field"),
        [
            ([Task("a", id="t", depends_on=["nowhere"])], "t", "depends_on"),
            ([Task("a", id="t", depends_on=["u"]), Task("a", id="u", depends_on=["t"])], "t",
             "depends_on"),
            ([Task("a", id="t"), Task("a", id="t")], "t", "id"),
            ([Task("a", id="t", payload=object())], "t", "payload"),
            ([Task("a", id="t", tags=["g"], depends_on=["w"]),
              Task("a", id="w", depends_on_tags=["g"])], "t", "depends_on"),
        ],
    )  # fmt: skip
    async def test_a_refused_batch_writes_nothing_and_names_the_task_and_field(
        self, conn: asyncpg.Connection, tasks: list[Task], task_id: str, field: str
    ) -> None:
        with pytest.raises(InputError) as refused:
            await admit(conn, "r", [Task("a", id="ok"), *tasks], admission=admission())
        assert (refused.value.task_id, refused.value.field) == (task_id, field)
        assert task_id in str(refused.value)
        assert await states(conn) == {}
        assert await conn.fetchval("SELECT count(*) FROM orchestra.groups") == 0

    async def test_an_id_admitted_before_is_idempotent_when_the_same_else_refused(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", {"n": 1}, id="t")], admission=admission())
        again = await admit(conn, "r", [Task("a", {"n": 1}, id="t")], admission=admission())
        assert again.ids == []
        with pytest.raises(InputError, match="duplicate task id 't'") as refused:
            await admit(conn, "r", [Task("a", {"n": 2}, id="t")], admission=admission())
        assert refused.value.field == "id"

    async def test_a_streamed_batch_depends_only_on_tasks_before_it(
        self, conn: asyncpg.Connection
    ) -> None:
        with pytest.raises(InputError, match="depends on unknown task 'later'") as refused:
            await admit(
                conn, "r", [Task("a", id="t", depends_on=["later"]), Task("a", id="later")],
                admission=admission(), forward=False,
            )  # fmt: skip
        assert refused.value.field == "depends_on"

    async def test_depending_on_an_ended_task_of_an_earlier_batch(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="good"), Task("a", id="bad")], admission=admission())
        await finish(conn, "good")
        await finish(conn, "bad", FAILED)
        admitted = await admit(
            conn, "r",
            [Task("a", id="after_good", depends_on=["good"]),
             Task("a", id="after_bad", depends_on=["bad"]),
             Task("a", id="below", depends_on=["after_bad"])],
            admission=admission(),
        )  # fmt: skip
        assert admitted.ready == ["after_good"]
        assert admitted.skipped == ["after_bad", "below"]
        row = await conn.fetchrow(
            "SELECT error, error_type FROM orchestra.tasks WHERE id = 'after_bad'"
        )
        assert row is not None
        assert (row[0], row[1]) == ("dependency 'bad' failed", "DependencyFailed")


class TestGroups:
    async def test_a_waiter_waits_for_every_member_and_the_input_closed(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="m1", tags=["g"]), Task("a", id="m2", tags=["g"]),
             Task("b", id="w", depends_on_tags=["g"])],
            admission=admission(),
        )  # fmt: skip
        await finish(conn, "m1")
        await finish(conn, "m2")
        assert (await states(conn))["w"] == "pending"  # more members may still come
        settled = await close_input(conn, "r")
        assert settled.ready == [("w", "b")]

    async def test_closing_the_input_frees_the_waiters_of_groups_in_the_order_they_were_named(
        self, conn: asyncpg.Connection
    ) -> None:
        # As in memory: groups close in the order the run's tasks first named them, not by tag.
        await admit(
            conn, "r",
            [Task("a", id="w2", depends_on_tags=["g2"]), Task("a", id="w1", depends_on_tags=["g1"])],
            admission=admission(),
        )  # fmt: skip
        settled = await close_input(conn, "r")
        assert settled.ready == [("w2", "a"), ("w1", "a")]

    async def test_a_group_closes_only_once_the_task_named_after_it_ended(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r", [Task("a", id="g"), Task("b", id="w", depends_on_tags=["g"])],
            admission=admission(),
        )  # fmt: skip
        await close_input(conn, "r")
        assert (await states(conn))["w"] == "pending"
        await finish(conn, "g", spawned=[Task("a", id="child", tags=["g"])])
        assert await states(conn) == {"g": "succeeded", "child": "ready", "w": "pending"}
        await finish(conn, "child")
        assert (await states(conn))["w"] == "ready"

    async def test_a_member_that_fails_skips_the_waiters_and_what_waits_for_them(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="m1", tags=["g"]), Task("a", id="m2", tags=["g"]),
             Task("b", id="w", depends_on_tags=["g"]), Task("b", id="below", depends_on=["w"])],
            admission=admission(),
        )  # fmt: skip
        await close_input(conn, "r")
        await finish(conn, "m1", FAILED)
        assert await states(conn) == {
            "m1": "failed", "m2": "ready", "w": "skipped", "below": "skipped"
        }  # fmt: skip
        error = await conn.fetchval("SELECT error FROM orchestra.tasks WHERE id = 'w'")
        assert error == "group 'g' member 'm1' failed"


class TestSettling:
    async def test_a_success_readies_what_waited_only_for_it(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="p1"), Task("a", id="p2"), Task("b", id="child", depends_on=["p1", "p2"])],
            admission=admission(),
        )  # fmt: skip
        await finish(conn, "p1")
        assert ((await states(conn))["child"], await waiting(conn, "child")) == ("pending", 1)
        await finish(conn, "p2")
        assert (await states(conn))["child"] == "ready"

    async def test_a_terminal_failure_skips_what_depends_on_it_transitively(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="root"), Task("a", id="other"), Task("a", id="c1", depends_on=["root"]),
             Task("a", id="c2", depends_on=["c1", "other"]),
             Task("a", id="m", tags=["g"], depends_on=["c2"]),
             Task("a", id="w", depends_on_tags=["g"])],
            admission=admission(),
        )  # fmt: skip
        await finish(conn, "root", FAILED)
        assert await states(conn) == {
            "root": "failed", "other": "ready", "c1": "skipped", "c2": "skipped",
            "m": "skipped", "w": "skipped",
        }  # fmt: skip
        assert await conn.fetchval("SELECT failed FROM orchestra.groups WHERE tag = 'g'") == (
            "group 'g' member 'm' skipped"
        )

    async def test_spawns_are_admitted_with_their_parent_and_wait_for_it(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="p"), Task("a", id="after", depends_on=["p"])],
                    admission=admission())  # fmt: skip
        await finish(conn, "p", spawned=[Task("b", 1), Task("b", 2, depends_on=["p"])])
        rows = await conn.fetch(
            "SELECT id, parent, idx, state FROM orchestra.tasks WHERE parent IS NOT NULL "
            "ORDER BY idx"
        )
        assert [tuple(r) for r in rows] == [
            ("p/b#1", "p", 0, "ready"), ("p/b#2", "p", 1, "ready")
        ]  # fmt: skip
        # Queued as in memory: the spawn waiting for nothing first, then what the end freed.
        order = [t.id for t in await claim(conn, "r", {"a": 5, "b": 5}, owner="w", lease=30)]
        assert order == ["p/b#1", "after", "p/b#2"]

    async def test_a_refused_spawn_leaves_the_task_as_it_was(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="p"), Task("a", id="after", depends_on=["p"])],
                    admission=admission())  # fmt: skip
        token = await take(conn, "p")
        with pytest.raises(InputError, match="nowhere") as refused:
            await complete(
                conn, "r", "w", [End("p", token, SUCCEEDED, "1")],
                spawned={"p": [Task("b", id="s", depends_on=["nowhere"])]},
                admission=admission(),
            )  # fmt: skip
        assert (refused.value.task_id, refused.value.field) == ("s", "depends_on")
        assert await states(conn) == {"p": "claimed", "after": "pending"}

    async def test_a_refused_completion_settles_nothing(self, conn: asyncpg.Connection) -> None:
        await admit(conn, "r", [Task("a", id="p"), Task("a", id="after", depends_on=["p"])],
                    admission=admission())  # fmt: skip
        token = await take(conn, "p")
        (written,) = await complete(
            conn, "r", "w", [End("p", token + 1, SUCCEEDED, "1")],
            spawned={"p": [Task("b", id="s")]}, admission=admission(),
        )  # fmt: skip
        assert not written
        assert await states(conn) == {"p": "claimed", "after": "pending"}

    async def test_what_becomes_ready_is_notified_on_the_runs_channel(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        heard: list[tuple[str, str]] = []
        listener = await asyncpg.connect(pg_dsn)
        got = asyncio.Event()

        def hear(_: Any, pid: int, channel: str, payload: object) -> None:
            heard.append((channel, str(payload)))
            got.set()

        await listener.add_listener(channel_of("r"), hear)
        try:
            await admit(conn, "r", [Task("a", id="p"), Task("b", id="c", depends_on=["p"])],
                        admission=admission())  # fmt: skip
            await asyncio.wait_for(got.wait(), 10)
            got.clear()
            token = await take(conn, "p")
            await complete(conn, "r", "w", [End("p", token, SUCCEEDED, "1")])
            await asyncio.wait_for(got.wait(), 10)
        finally:
            await listener.close()
        assert [(c, json.loads(p)) for c, p in heard] == [
            ("orchestra:r", {"run": "r", "kinds": ["a"]}),
            ("orchestra:r", {"run": "r", "kinds": ["b"]}),
        ]


class TestKeysWithinARun:
    """A task whose key another task of the run holds is the same work: it follows that task."""

    async def test_followers_never_run_and_end_with_the_holders_output_and_agent(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="k1", key="same"), Task("a", id="k2", key="same"),
             Task("b", id="d", depends_on=["k2"])],
            admission=admission(),
        )  # fmt: skip
        await admit(conn, "r", [Task("a", id="k3", key="same")], admission=admission())
        assert await states(conn) == {
            "k1": "ready",
            "k2": "pending",
            "k3": "pending",
            "d": "pending",
        }
        assert [await waiting(conn, t) for t in ("k2", "k3")] == [1, 1]
        token = await take(conn, "k1")
        await complete(conn, "r", "w", [End("k1", token, SUCCEEDED, '{"v": 1}', "x")])
        rows = await conn.fetch(
            "SELECT id, state, output::text, agent, attempts FROM orchestra.tasks "
            "WHERE id IN ('k2', 'k3') ORDER BY id"
        )
        assert [tuple(r) for r in rows] == [
            ("k2", "succeeded", '{"v": 1}', "x", 0), ("k3", "succeeded", '{"v": 1}', "x", 0)
        ]  # fmt: skip
        assert (await states(conn))["d"] == "ready"  # what waited for a follower, freed by it
        assert await conn.fetchval("SELECT count(*) FROM orchestra.follows") == 0

    async def test_a_task_admitted_once_its_holder_succeeded_ends_at_admission(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="k1", key="same")], admission=admission())
        token = await take(conn, "k1")
        await complete(conn, "r", "w", [End("k1", token, SUCCEEDED, '"once"', "x")])
        admitted = await admit(
            conn, "r", [Task("a", id="k2", key="same"), Task("b", id="d", depends_on=["k2"])],
            admission=admission(),
        )  # fmt: skip
        assert admitted.ready == ["d"]
        row = await conn.fetchrow(
            "SELECT state, output::text, agent FROM orchestra.tasks WHERE id = 'k2'"
        )
        assert row is not None
        assert tuple(row) == ("succeeded", '"once"', "x")

    async def test_tasks_of_one_batch_that_follow_a_holder_that_succeeded_all_end_with_it(
        self, conn: asyncpg.Connection
    ) -> None:
        # b depends on a: a's end makes b ready, and b ends all the same, as in memory.
        await admit(conn, "r", [Task("a", id="k1", key="same")], admission=admission())
        await finish(conn, "k1")
        admitted = await admit(
            conn, "r",
            [Task("a", id="a", key="same"), Task("a", id="b", key="same", depends_on=["a"])],
            admission=admission(),
        )  # fmt: skip
        assert await states(conn) == {"k1": "succeeded", "a": "succeeded", "b": "succeeded"}
        assert admitted.ready == []

    async def test_a_holder_that_does_not_succeed_hands_the_key_to_the_next_in_line(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r", [Task("a", id=f"k{i}", key="same") for i in (1, 2, 3)],
            admission=admission(),
        )  # fmt: skip
        await finish(conn, "k1", FAILED)
        assert await states(conn) == {"k1": "failed", "k2": "ready", "k3": "pending"}
        assert await conn.fetchval("SELECT holder FROM orchestra.run_keys") == "k2"
        await finish(conn, "k2", FAILED)
        assert (await states(conn))["k3"] == "ready"
        await finish(conn, "k3")
        assert set((await states(conn)).values()) == {"failed", "succeeded"}

    async def test_heirs_made_ready_by_one_failure_are_queued_in_the_memory_stores_order(
        self, conn: asyncpg.Connection
    ) -> None:
        # p's failure dooms h2, then a; the memory store skips the last one doomed first (a
        # stack), and all that its skip dooms before the rest: a, h1 (f1 gets k1), then h2.
        await admit(
            conn, "r",
            [Task("a", id="p"), Task("a", id="h2", key="k2", depends_on=["p"]),
             Task("a", id="a", depends_on=["p"]), Task("a", id="h1", key="k1", depends_on=["a"]),
             Task("a", id="f2", key="k2"), Task("a", id="f1", key="k1")],
            admission=admission(),
        )  # fmt: skip
        await finish(conn, "p", FAILED)
        order = [t.id for t in await claim(conn, "r", {"a": 5}, owner="w", lease=30)]
        assert order == ["f1", "f2"]

    async def test_a_follower_waits_for_its_own_dependencies_too_once_it_holds_the_key(
        self, conn: asyncpg.Connection
    ) -> None:
        await admit(
            conn, "r",
            [Task("a", id="p"), Task("a", id="k1", key="same"),
             Task("a", id="k2", key="same", depends_on=["p"])],
            admission=admission(),
        )  # fmt: skip
        assert await waiting(conn, "k2") == 2
        await finish(conn, "k1", FAILED)
        assert ((await states(conn))["k2"], await waiting(conn, "k2")) == ("pending", 1)
        await finish(conn, "p")
        assert (await states(conn))["k2"] == "ready"

    async def test_a_holder_that_waits_for_a_later_task_with_its_key_follows_that_task(
        self, conn: asyncpg.Connection
    ) -> None:
        # h waits for group g; r, with h's key, joins g: were r to follow h, neither would run.
        await admit(
            conn, "r", [Task("a", id="h", key="same", depends_on_tags=["g"])],
            admission=admission(),
        )  # fmt: skip
        admitted = await admit(
            conn, "r", [Task("a", id="r", key="same", tags=["g"])], admission=admission(),
            forward=False,
        )  # fmt: skip
        assert admitted.ready == ["r"]
        assert await conn.fetchval("SELECT holder FROM orchestra.run_keys") == "r"
        assert await conn.fetchval("SELECT took_key FROM orchestra.tasks WHERE id = 'r'")
        token = await take(conn, "r")
        await complete(conn, "r", "w", [End("r", token, SUCCEEDED, '"done"', "y")])
        row = await conn.fetchrow(
            "SELECT state, output::text, agent FROM orchestra.tasks WHERE id = 'h'"
        )
        assert row is not None
        assert tuple(row) == ("succeeded", '"done"', "y")

    async def test_a_streamed_member_depending_on_a_follower_of_its_groups_waiter_is_refused(
        self, conn: asyncpg.Connection
    ) -> None:
        # k2 follows k1, which waits for group g: a member of g depending on k2 would wait for k1
        # through it, a cycle nothing would ever end.
        for task in (Task("a", id="k1", key="same", depends_on_tags=["g"]),
                     Task("a", id="k2", key="same")):  # fmt: skip
            await admit(conn, "r", [task], admission=admission(), forward=False)
        with pytest.raises(InputError, match="cycle") as refused:
            await admit(
                conn, "r", [Task("a", id="m", tags=["g"], depends_on=["k2"])],
                admission=admission(), forward=False,
            )  # fmt: skip
        assert (refused.value.task_id, refused.value.field) == ("m", "tags")
        assert "m" not in await states(conn)

    async def test_a_follower_admitted_while_its_holder_ends_ends_with_it(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="k1", key="same")], admission=admission())
        token = await take(conn, "k1")
        other = await asyncpg.connect(pg_dsn)
        try:
            admitting = conn.transaction()
            await admitting.start()
            await admit(conn, "r", [Task("a", id="k2", key="same")], admission=admission())
            ending = asyncio.ensure_future(
                complete(other, "r", "w", [End("k1", token, SUCCEEDED, '"v"', "x")])
            )
            await blocked(conn, other, ending)  # on the key the admission holds
            await admitting.commit()
            assert await ending == [True]
        finally:
            await other.close()
        assert await states(conn) == {"k1": "succeeded", "k2": "succeeded"}

    async def test_a_follower_admitted_while_its_holder_fails_takes_the_key(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="k1", key="same")], admission=admission())
        token = await take(conn, "k1")
        other = await asyncpg.connect(pg_dsn)
        try:
            ending = other.transaction()
            await ending.start()
            await complete(other, "r", "w", [End("k1", token, FAILED)])
            admitting = asyncio.ensure_future(
                admit(conn, "r", [Task("a", id="k2", key="same")], admission=admission())
            )
            await blocked(other, conn, admitting)  # on the key the end holds
            await ending.commit()
            assert (await admitting).ready == ["k2"]
        finally:
            await other.close()
        assert await states(conn) == {"k1": "failed", "k2": "ready"}


class Ends(NoListener):
    """A listener that records the ends it hears: (id, output, agent), in order."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, Any, str | None]] = []

    def finished(self, record: Any) -> None:
        self.ended.append((record.task_id, record.output, record.agent))


class TestTheCoordinatorsMirror:
    """The coordinator's run (`PostgresRun`, driven by hand) hears the ends a worker writes and
    plays them into its mirror as the database settled them."""

    @pytest.fixture
    def coordinator(self, model_dsn: str) -> Iterator[tuple[Any, Ends]]:
        from orchestra.stores._postgres._store import PostgresStore

        store = PostgresStore(model_dsn)
        ends = Ends()
        try:
            yield store.open_run(
                "run", admission=admission(), listener=ends, clock=lambda: 0.0,
                task_timeout=None, compact=False,
            ), ends  # fmt: skip
        finally:
            store.close()

    @staticmethod
    async def worker(dsn: str, task_id: str) -> list[str]:
        """Claim `task_id` as another process, succeed it ("v", agent "w"); the feed then."""
        conn = await asyncpg.connect(dsn)
        try:
            (task,) = await claim(conn, "run", {"a": 1}, owner="worker", lease=30)
            assert task.id == task_id
            await complete(conn, "run", "worker", [End(task_id, task.token, SUCCEEDED, '"v"', "w")])
            feed: list[str] = await conn.fetchval(
                "SELECT array_agg(id) FROM orchestra.ended, unnest(ids) AS id"
            )
            return feed
        finally:
            await conn.close()

    def test_a_workers_success_is_heard_with_its_output_and_frees_its_dependents(
        self, model_dsn: str, coordinator: tuple[Any, Ends]
    ) -> None:
        run, ends = coordinator
        run.admit([Task("a", id="p"), Task("b", id="d", depends_on=["p"])], where="tasks",
                  forward=True)  # fmt: skip
        assert asyncio.run(self.worker(model_dsn, "p")) == ["p"]
        record = run.claim()  # hears the feed, then claims what the end freed
        assert ends.ended == [("p", "v", "w")]
        assert record is not None
        assert record.id == "d"

    def test_a_followers_end_is_heard_once(
        self, model_dsn: str, coordinator: tuple[Any, Ends]
    ) -> None:
        # The database ends the follower in the worker's transaction; the feed has the holder's
        # end alone, and the coordinator's mirror ends the follower from it, as the database did.
        run, ends = coordinator
        run.admit([Task("a", id="k1", key="same"), Task("a", id="k2", key="same")],
                  where="tasks", forward=True)  # fmt: skip
        assert asyncio.run(self.worker(model_dsn, "k1")) == ["k1"]
        assert run.claim() is None
        assert ends.ended == [("k1", "v", "w"), ("k2", "v", "w")]
        assert run.unfinished == 0


class TestConcurrentSettling:
    async def test_two_parents_completed_at_once_ready_their_child_once(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        workers = [await asyncpg.connect(pg_dsn) for _ in range(2)]
        notified: list[str] = []
        listener = await asyncpg.connect(pg_dsn)
        await listener.add_listener(channel_of("r"), lambda *a: notified.append(a[3]))
        try:
            for i in range(30):
                await admit(
                    conn, "r",
                    [Task("a", id=f"p{i}"), Task("a", id=f"q{i}"),
                     Task("b", id=f"c{i}", depends_on=[f"p{i}", f"q{i}"])],
                    admission=admission(),
                )  # fmt: skip
                tokens = [await take(conn, f"p{i}"), await take(conn, f"q{i}")]
                await asyncio.gather(*(
                    complete(w, "r", "w", [End(t, token, SUCCEEDED, "1")])
                    for w, t, token in zip(workers, [f"p{i}", f"q{i}"], tokens, strict=True)
                ))  # fmt: skip
                assert (await states(conn))[f"c{i}"] == "ready"
            await conn.execute("SELECT 1")
            await asyncio.sleep(0.2)  # the last notifications, delivered on commit
        finally:
            for w in [*workers, listener]:
                await w.close()
        assert [json.loads(p)["kinds"] for p in notified].count(["b"]) == 30
        children = await claim(conn, "r", {"b": 100}, owner="w", lease=30)
        assert sorted(t.id for t in children) == sorted(f"c{i}" for i in range(30))

    async def test_a_waiter_admitted_while_the_last_member_ends_is_freed(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="m", tags=["g"])], admission=admission())
        await close_input(conn, "r")
        token = await take(conn, "m")
        other = await asyncpg.connect(pg_dsn)
        try:
            admitting = conn.transaction()
            await admitting.start()
            await admit(conn, "r", [Task("b", id="w", depends_on_tags=["g"])],
                        admission=admission())  # fmt: skip
            ending = asyncio.ensure_future(
                complete(other, "r", "w", [End("m", token, SUCCEEDED, "1")])
            )
            await blocked(conn, other, ending)  # on the group the admission holds
            await admitting.commit()
            assert await ending == [True]
        finally:
            await other.close()
        assert await states(conn) == {"m": "succeeded", "w": "ready"}

    async def test_a_waiter_of_a_new_group_admitted_while_the_input_closes_is_freed(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        other = await asyncpg.connect(pg_dsn)
        try:
            admitting = conn.transaction()
            await admitting.start()
            await admit(conn, "r", [Task("b", id="w", depends_on_tags=["nobody"])],
                        admission=admission())  # fmt: skip
            closing = asyncio.ensure_future(close_input(other, "r"))
            await blocked(conn, other, closing)  # on the run the admission read
            await admitting.commit()
            await closing
        finally:
            await other.close()
        assert await states(conn) == {"w": "ready"}

    async def test_processes_running_a_graph_side_by_side_end_every_task_once(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        # Layers of tasks, each depending on some of the layer above and waiting for groups that
        # members of every layer join: ends, group closes and readying meet across connections.
        tasks: list[Task] = []
        for layer in range(6):
            for i in range(40):
                above = [f"t{layer - 1}.{(i + k) % 40}" for k in (0, 7)] if layer else []
                tasks.append(Task(
                    "a", id=f"t{layer}.{i}", depends_on=above, tags=[f"g{(layer + i) % 3}"]
                    if layer < 5 else [], depends_on_tags=["g1"] if layer == 5 and i % 4 == 0
                    else [],
                ))  # fmt: skip
        await admit(conn, "r", tasks, admission=admission())
        await close_input(conn, "r")
        done: list[str] = []

        async def process(name: str) -> None:
            worker = await asyncpg.connect(pg_dsn)
            try:
                idle = 0
                while idle < 50:  # others may still ready something: look again a while
                    batch = await claim(worker, "r", {"a": 5}, owner=name, lease=30)
                    if not batch:
                        idle += 1
                        await asyncio.sleep(0.01)
                        continue
                    idle = 0
                    ends = [End(t.id, t.token, SUCCEEDED, "1") for t in batch]
                    assert all(await complete(worker, "r", name, ends))
                    done.extend(t.id for t in batch)
            finally:
                await worker.close()

        await asyncio.gather(*(process(f"w{i}") for i in range(4)))
        assert sorted(done) == sorted(t.id for t in tasks)  # each once
        assert set((await states(conn)).values()) == {"succeeded"}

    async def test_a_transaction_aborted_to_break_a_deadlock_runs_again(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        await admit(conn, "r", [Task("a", id="x"), Task("a", id="y")], admission=admission())
        others = [await asyncpg.connect(pg_dsn) for _ in range(2)]
        both_hold_one = asyncio.Barrier(2)
        tries = {"x": 0, "y": 0}

        def step(first: str, then: str) -> Any:
            async def locks(tx: asyncpg.Connection) -> str:
                tries[first] += 1
                lock = "SELECT 1 FROM orchestra.tasks WHERE id = $1 FOR UPDATE"
                await tx.execute(lock, first)
                if tries[first] == 1:  # the first try of each waits for the other's first lock
                    await both_hold_one.wait()
                await tx.execute(lock, then)
                return first

            return locks

        try:
            done = await asyncio.gather(
                transaction(others[0], step("x", "y")), transaction(others[1], step("y", "x"))
            )
        finally:
            for other in others:
                await other.close()
        assert list(done) == ["x", "y"]
        # PostgreSQL aborted one, which ran again; on a busy machine a try again may take its
        # first lock before the other wakes to the lock it waited for, and deadlock once more.
        assert max(tries.values()) >= 2

    async def test_a_coordinators_write_aborted_to_break_a_deadlock_runs_again(
        self, pg_dsn: str, conn: asyncpg.Connection
    ) -> None:
        # Closing the input locks the groups, then their waiters; an end locks its dependents,
        # then its groups: "w" depends on "x" (a member of g1) and waits for g2, which the close
        # closes. PostgreSQL aborts the close (its wait is the one that times out first here);
        # the coordinator's fenced write runs again, as any other transaction would.
        lease = await coordinator.acquire(conn, "r", owner="c", lease=30)
        assert lease is not None
        tasks = [
            Task("a", id="x", tags=["g1"]),
            Task("a", id="y", tags=["g2"]),
            Task("a", id="w", depends_on=["x"], depends_on_tags=["g2"]),
        ]
        await admit(conn, "r", tasks, admission=admission())
        claimed = {t.id: t.token for t in await claim(conn, "r", {"a": 2}, owner="p", lease=30)}
        assert await complete(conn, "r", "p", [End("y", claimed["y"], SUCCEEDED, "1")])
        worker, writer, blocker = [await asyncpg.connect(pg_dsn) for _ in range(3)]
        await worker.execute("SET deadlock_timeout = '10s'")  # the writer finds the deadlock
        try:
            stuck = blocker.transaction()
            await stuck.start()
            await blocker.execute("SELECT FROM orchestra.tasks WHERE id = 'w' FOR UPDATE")
            ending = asyncio.ensure_future(
                complete(worker, "r", "p", [End("x", claimed["x"], SUCCEEDED, "1")])
            )
            await blocked(conn, worker, ending)  # "x" ended, for its dependent "w"
            closing = asyncio.ensure_future(
                jobs.apply(writer, "r", lease, admission(), Growth(), [("close_input", None)])
            )
            await blocked(conn, writer, closing)  # g1 and g2 locked, for g2's waiter "w"
            await stuck.rollback()
            done = await asyncio.gather(ending, closing)
        finally:
            for other in (worker, writer, blocker):
                await other.close()
        assert done[0] == [True]
        assert await states(conn) == {"x": SUCCEEDED, "y": SUCCEEDED, "w": "ready"}


async def blocked(
    conn: asyncpg.Connection, other: asyncpg.Connection, step: asyncio.Future[Any]
) -> None:
    """Wait until `other`, running `step`, waits for a lock (or `step` is done: then it did not
    wait for what `conn`'s open transaction holds)."""
    pid = other.get_server_pid()
    for _ in range(500):
        if step.done():
            return
        waiting = await conn.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the other connection neither waited for a lock nor finished")


# -- the model: the memory store's semantics, the same in the database -------------------------


TAGS = ("g1", "g2")
KEYS = ("k1", "k2")  # a few keys, shared by several tasks of a run


@st.composite
def task_specs(draw: st.DrawFn, known: list[str], prefix: str, n: int) -> list[dict[str, Any]]:
    """`n` tasks as plain specs (built twice, one `Task` per store): ids `<prefix><i>`, each
    depending on some of `known` and of the ones before it, in groups and waiting for groups."""
    specs: list[dict[str, Any]] = []
    for i in range(n):
        task_id = f"{prefix}{i}"
        before = known + [s["id"] for s in specs]
        specs.append({
            "id": task_id,
            "kind": draw(st.sampled_from(KINDS)),
            "priority": draw(st.integers(0, 2)),
            "depends_on": draw(st.lists(st.sampled_from(before), unique=True, max_size=2))
            if before else [],
            "tags": draw(st.lists(st.sampled_from(TAGS), unique=True, max_size=1)),
            "depends_on_tags": draw(st.lists(st.sampled_from(TAGS), unique=True, max_size=1)),
            "key": draw(st.sampled_from((None, *KEYS, KEYS[0]))),
        })  # fmt: skip
    return specs


def build(specs: Sequence[dict[str, Any]]) -> list[Task]:
    return [
        Task(s["kind"], s["id"], id=s["id"], priority=s["priority"], depends_on=s["depends_on"],
             tags=s["tags"], depends_on_tags=s["depends_on_tags"], key=s["key"])
        for s in specs
    ]  # fmt: skip


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    first = draw(task_specs([], "t", draw(st.integers(1, 6))))
    ids = [s["id"] for s in first]
    second = draw(st.one_of(st.just([]), task_specs(ids, "s", draw(st.integers(1, 3)))))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from([SUCCEEDED, SUCCEEDED, FAILED]),
                st.integers(0, 2),  # how many tasks the attempt spawns (on a success)
                st.data(),
            ),
            max_size=14,
        )
    )
    return {
        "first": first,
        "second": second,
        "close_at": draw(st.integers(0, 6)),
        "steps": steps,
    }


def ran(task_id: str, token: int, state: str) -> End:
    """The end of an attempt of the model test: its output and agent name the task that ran."""
    return End(task_id, token, state, json.dumps(task_id), task_id)


@pytest.fixture
def model_dsn(pg: PgDatabases) -> Iterator[str]:
    """A database with orchestra's schema for every example of a model test (a run each)."""
    dsn = asyncio.run(pg.create())
    yield dsn
    asyncio.run(pg.drop(dsn))


class TestTheMemoryStoresSemantics:
    """Hypothesis draws DAGs with groups and a few keys shared by several tasks, two batches (a
    whole list, then a streamed one), a close of the input at some step, and attempts that succeed
    (spawning some tasks) or fail for good; the same operations go to a `MemoryRun` and to the
    database, claiming the best ready task from each. After every step both hold the same tasks in
    the same states (with the same outputs and agents, the same key holders, and as many things
    waited for), and claim the same task next (priority, then the order they became ready)."""

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(scenario=scenarios())
    def test_the_same_operations_end_in_the_same_states(
        self, model_dsn: str, scenario: dict[str, Any]
    ) -> None:
        asyncio.run(self._play(model_dsn, scenario))

    async def _play(self, dsn: str, scenario: dict[str, Any]) -> None:
        memory = MemoryStore().open_run(
            "m", admission=admission(), listener=NoListener(), clock=lambda: 0.0,
            task_timeout=None, compact=False,
        )  # fmt: skip
        conn = await asyncpg.connect(dsn)
        run = f"run{await conn.fetchval('SELECT count(*) FROM orchestra.runs')}"
        await conn.execute("INSERT INTO orchestra.runs (id) VALUES ($1)", run)
        sql_admission = admission()
        try:
            for batch, forward in ((scenario["first"], True), (scenario["second"], False)):
                if not batch:
                    continue
                refused: list[tuple[str | None, str | None] | None] = [None, None]
                try:
                    memory.admit(build(batch), where="input", forward=forward)
                except InputError as exc:
                    refused[0] = (exc.task_id, exc.field)
                try:
                    await admit(conn, run, build(batch), admission=sql_admission, forward=forward)
                except InputError as exc:
                    refused[1] = (exc.task_id, exc.field)
                assert refused[0] == refused[1]
            await self._same(memory, conn, run)
            for step, (status, spawns, data) in enumerate(scenario["steps"]):
                if step == scenario["close_at"]:
                    memory.close_input()
                    await close_input(conn, run)
                    await self._same(memory, conn, run)
                record = memory.claim()
                claimed = await claim(conn, run, dict.fromkeys(KINDS, 1), owner="w", lease=30,
                                      limit=1)  # fmt: skip
                assert [t.id for t in claimed] == ([] if record is None else [record.id])
                if record is None:
                    continue
                (task,) = claimed
                known = [r.id for r in memory.records() if r.id != record.id]
                specs = []
                if status == SUCCEEDED and spawns:
                    specs = data.draw(task_specs(known, f"{record.id}.", spawns))
                refused = [None, None]
                assert memory.start(record, record.token, "x")
                try:
                    # Each spawn checked as it is spawned (the engine's `check_spawn`), then
                    # admitted with the end.
                    spawned: dict[str, Task] = {}
                    for spawn in build(specs):
                        memory.check_spawn(spawn, record, spawned)
                        spawned[spawn.id] = spawn
                    memory.settle(
                        record,
                        record.token,
                        status,
                        record.id,
                        spawned=list(spawned.values()),
                        agent=record.id,
                        error=None if status == SUCCEEDED else "no",
                    )
                except InputError as exc:
                    refused[0] = (exc.task_id, exc.field)
                try:
                    await complete(
                        conn, run, "w", [ran(task.id, task.token, status)],
                        spawned={task.id: build(specs)}, admission=sql_admission,
                    )  # fmt: skip
                except InputError as exc:
                    refused[1] = (exc.task_id, exc.field)
                assert refused[0] == refused[1]
                if refused[0] is not None:  # spawns refused: the attempt ends without them
                    memory.settle(record, record.token, status, record.id, agent=record.id)
                    await complete(conn, run, "w", [ran(task.id, task.token, status)])
                await self._same(memory, conn, run)
            # What is left, claimed in turn: the same order to the end.
            while True:
                record = memory.claim()
                claimed = await claim(conn, run, dict.fromkeys(KINDS, 1), owner="w", lease=30,
                                      limit=1)  # fmt: skip
                assert [t.id for t in claimed] == ([] if record is None else [record.id])
                if record is None:
                    break
                memory.start(record, record.token, "x")
                memory.settle(record, record.token, SUCCEEDED, record.id, agent=record.id)
                await complete(conn, run, "w", [ran(record.id, claimed[0].token, SUCCEEDED)])
                await self._same(memory, conn, run)
        finally:
            await conn.close()

    async def _same(self, memory: Any, conn: asyncpg.Connection, run: str) -> None:
        expected = {r.id: r.state for r in memory.records()}
        assert await states(conn, run) == expected
        # A task that succeeded has the output and agent of the task that ran: itself, or the
        # holder of its key that it followed.
        rows = await conn.fetch(
            "SELECT id, output::text, agent FROM orchestra.tasks "
            "WHERE run_id = $1 AND state = 'succeeded'",
            run,
        )
        assert {r[0]: (json.loads(r[1]), r[2]) for r in rows} == {
            r.id: (r.output, r.agent) for r in memory.records() if r.state == SUCCEEDED
        }
        # The same task holds each key; or both holders ended without succeeding (tasks skipped
        # by one cascade, in another order): either way the next task with the key takes it over.
        rows = await conn.fetch("SELECT key, holder FROM orchestra.run_keys WHERE run_id = $1", run)
        held = {r[0]: r[1] for r in rows}
        lost = {r.id for r in memory.records() if r.state in (FAILED, CANCELLED, SKIPPED)}
        expected_keys = {r.task.key: r.id for r in memory.records() if memory.holds_key(r)}
        assert held.keys() == expected_keys.keys()
        for key, holder in expected_keys.items():
            assert held[key] == holder or {held[key], holder} <= lost
        rows = await conn.fetch(
            "SELECT id, took_key, waiting, state FROM orchestra.tasks WHERE run_id = $1", run
        )
        assert {r[0] for r in rows if r[1]} == {
            r.id for r in memory.records() if memory.took_key(r)
        }
        assert {r[0]: r[2] for r in rows if r[3] == "pending"} == {
            r.id: r.waiting for r in memory.records() if r.state == PENDING
        }
        for record in memory.records():
            if record.state == SKIPPED:
                assert record.error_type == "DependencyFailed"
