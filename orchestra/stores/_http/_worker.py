"""A worker's side of a store it reaches through the service (``orchestra worker --url``): what
`orchestra.stores._worker.Worker` asks of its store (its `Backend`), as requests to the service's
workers' routes (``/api/workers``, `orchestra._service._work`), which call the store's own backend
on the worker's behalf.

It sits with the stores, beside `_sqlite._worker` and `_postgres._worker`, because it is one more
`Backend`: the worker above it does not know which it has. It imports httpx and pydantic only,
never the service (FastAPI): a worker machine installs the ``remote`` extra, not the ``service``
one. The JSON both ends speak is `._wire`'s.

**Fencing** is the store's: every claim hands out a lease token, and a heartbeat, completion or
release names the leases it is about; the database refuses what a lease no longer allows (a worker
paused past its lease gets ``false`` for its completion, counted `refused` by the worker).

**A lost service** (refused connections, timeouts, 502 / 503 / 504) is retried with capped,
jittered backoff (`orchestra._retry.backoff`) for `retry_for` seconds (at least the lease: by then
the worker's leases have lapsed in the store, and what it writes will be refused anyway), while
the worker's agents go on with the work they hold; past that, the call raises `StoreError`. A
service that restarted does not know the worker (409 ``unknown_worker``): it presents itself again
and repeats the call.

**Several services.** A worker may be given several addresses of one store's service (replicas of
``orchestra serve --dsn`` on one database): it talks to one at a time and, when that one cannot be
reached, moves to the next at once (a whole round of them failing is what the backoff waits
between). The store fences every write, so any replica may take any call; the one moved to does
not know the worker (409 ``unknown_worker``), and it presents itself there again. So a fleet of
workers survives a replica's death without a load balancer in front of the replicas.

A call whose answer was lost with the service may have been applied: a
repeated completion is then refused (the task is no longer leased) and counted as refused, though
its first write stands; a repeated claim leaves the first claim's tasks leased to no one who runs
them until their leases lapse (an attempt counted) or the worker hands back what it holds.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import httpx
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from ..._exceptions import StoreError
from ..._log import get_logger
from ..._retry import RetryPolicy, backoff
from .._worker_run import ending, spawn_data
from ._wire import (
    MAX_WAIT,
    Claimed,
    ClaimedTask,
    Closed,
    Completed,
    FailedAttempt,
    Heartbeat,
    Hello,
    Released,
)
from ._wire import worker_name as _worker_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping, Sequence
    from types import TracebackType

    from ..._admission import Admission
    from ..._task import Attempt, TaskResult
    from .._worker_run import Claim

__all__ = ("ServiceBackend",)

log = get_logger("orchestra")

# Backoff between retries of a call the service did not answer: from 50 ms, doubling, at most a
# second (a service back up is used within a second), fully jittered so that many workers cut off
# together do not come back in step.
_RETRY: Final = RetryPolicy(base=0.05, cap=1.0, jitter="full")
_RETRIED_STATUS: Final = frozenset((429, 502, 503, 504))
_API: Final = "/api/workers"

_M = TypeVar("_M", bound=BaseModel)


class ServiceBackend:
    """The claims, heartbeats and completions of a worker, through the service at `url` (or
    the first of several that answers) with the bearer `token` (of the ``worker`` role).

    Use it as an async context manager: entering asks the service for the token's id, the
    store's lease and poll and its clock (`Hello`); leaving closes the connections.

    Args:
        url: the service's base URL (``http://host:8000``), or several: replicas serving one
            store, moved between when the one in use cannot be reached.
        token: a bearer token of the worker role.
        retry_for: seconds a call is retried while the service cannot be reached (default: the
            store's lease, at least 10).
        timeout: seconds a request may take (a wake-up's long poll is given its poll on top).
        transport: an httpx transport to send through (default: httpx's own).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        token: str,
        *,
        retry_for: float | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        # Read from a file (a mounted secret, `"$(<file)"` and a newline), a token comes with
        # whitespace no token holds: sent as it is, it is no legal header.
        token = token.strip()
        if not urls:
            raise StoreError("ServiceBackend: give the service's URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._given_retry = retry_for
        self.retry_for = 30.0 if retry_for is None else float(retry_for)
        self._timeout = timeout
        # One client (one connection pool) per address: moving to another keeps the connections
        # open to the others, for when the fleet comes back to them.
        self._clients = [
            httpx.AsyncClient(
                base_url=u,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
                transport=transport,
            )
            for u in self.urls
        ]
        self._at = 0  # the index of the address in use
        self._rng = random.Random()
        self.lease = 30.0
        self.poll = 1.0
        self.token_id: str | None = None
        self._offset = 0.0  # the service's clock less this process's wall clock, seconds
        self._presence: tuple[str, dict[str, Any]] | None = None  # name, body: to present again

    async def __aenter__(self) -> ServiceBackend:
        try:
            await self.connect()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    @property
    def url(self) -> str:
        """The address in use."""
        return self.urls[self._at]

    async def _close(self) -> None:
        for client in self._clients:
            await client.aclose()

    async def connect(self) -> None:
        """Ask the service who this token is, the store's lease and poll, and its clock."""
        before = time.time()
        hello = Hello.model_validate_json((await self._call("GET", "/hello")).content)
        after = time.time()
        self.token_id = hello.token_id
        self.lease = hello.lease
        self.poll = hello.poll
        self._offset = hello.now - (before + after) / 2
        if self._given_retry is None:
            self.retry_for = max(hello.lease, 10.0)

    # -- the Backend -----------------------------------------------------------------------------

    def name(self, suffix: str) -> str:
        if self.token_id is None:
            raise StoreError("ServiceBackend: enter it (async with) before naming a worker")
        return _worker_name(socket.gethostname(), os.getpid(), self.token_id, suffix)

    @contextlib.asynccontextmanager
    async def present(
        self, name: str, run_id: str | None, kinds: Sequence[str]
    ) -> AsyncIterator[None]:
        body = {"run_id": run_id, "kinds": list(kinds)}
        await self._call("POST", f"/{name}", body)
        self._presence = (name, body)
        try:
            yield
        finally:
            self._presence = None
            # Shielded, and briefly: a service that is gone forgets the worker after a lease.
            with anyio.CancelScope(shield=True), contextlib.suppress(StoreError):
                await self._call("DELETE", f"/{name}", retry_for=min(self.retry_for, 3.0))

    async def claim(
        self, name: str, run_id: str | None, rooms: Mapping[str, int], room: int
    ) -> tuple[list[ClaimedTask], bool]:
        body = {"run_id": run_id, "rooms": dict(rooms), "room": room}
        answer = _read(Claimed, await self._call("POST", f"/{name}/claim", body))
        return answer.tasks, answer.maybe_over

    async def closed(self, run_id: str) -> bool:
        assert self._presence is not None
        name = self._presence[0]
        response = await self._call("GET", f"/{name}/closed", params={"run_id": run_id})
        return _read(Closed, response).closed

    async def wait(self, poll: float) -> None:
        assert self._presence is not None
        name = self._presence[0]
        poll = min(poll, MAX_WAIT)
        await self._call("POST", f"/{name}/wait", {"poll": poll}, read=poll + self._timeout)

    async def heartbeat(self, name: str, held: Sequence[Claim]) -> set[tuple[str, str]]:
        body = {"held": [_lease(c) for c in held]}
        answer = _read(Heartbeat, await self._call("POST", f"/{name}/heartbeat", body))
        return {(ref.run_id, ref.id) for ref in answer.lost}

    async def complete(
        self,
        name: str,
        wall0: float,
        ends: Sequence[tuple[Claim, TaskResult, Sequence[Attempt], Any]],
        notes: Sequence[tuple[Claim, Attempt]],
        admission: Admission | None,
    ) -> list[bool]:
        rows = []
        spawning = False
        for claimed, result, failures, spawned in ends:
            tasks, named_here = spawned if spawned is not None else (None, set())
            status, output, error, error_type, kept = ending(result, tasks)
            row: dict[str, Any] = {
                "lease": _lease(claimed),
                "kind": claimed.kind,
                "status": status,
                "output": output,
                "agent": result.agent,
                "error": error,
                "error_type": error_type,
                "defaulted": bool(result.defaulted),
                "attempts": result.attempts,
                "started": result.started,
                "failures": [_attempt(a) for a in failures],
            }
            if kept:
                spawning = True
                row["spawned"] = [spawn_data(t, t.id in named_here) for t in kept]
            rows.append(row)
        body = {
            "wall0": wall0 + self._offset,
            "kinds": sorted(admission.kinds) if spawning and admission is not None else [],
            "ends": rows,
            "notes": [{"lease": _lease(c), "attempt": _attempt(a)} for c, a in notes],
        }
        answer = _read(Completed, await self._call("POST", f"/{name}/complete", body))
        if len(answer.accepted) != len(ends):
            raise StoreError(
                f"the service at {self.url} answered {len(answer.accepted)} completions for "
                f"{len(ends)}: is it the same orchestra version as this worker?"
            )
        return answer.accepted

    async def release(self, name: str, held: Sequence[Claim] | None) -> int:
        body = {"held": None if held is None else [_lease(c) for c in held]}
        return _read(Released, await self._call("POST", f"/{name}/release", body)).released

    # -- requests --------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        read: float | None = None,
        retry_for: float | None = None,
    ) -> httpx.Response:
        """One request to the workers' routes, retried while the service cannot answer; a
        refusal (4xx) is a `StoreError` that says why."""
        content = None if body is None else to_json(body, fallback=repr)
        timeout = httpx.USE_CLIENT_DEFAULT if read is None else httpx.Timeout(read, connect=5.0)
        budget = self.retry_for if retry_for is None else retry_for
        began: float | None = None
        retry = 0
        presented = False
        tried = 0  # addresses that failed this call since the last wait
        while True:
            client = self._clients[self._at]
            try:
                response = await client.request(
                    method, _API + path, content=content, params=params, timeout=timeout
                )
            except httpx.LocalProtocolError as exc:  # never sent: sending again cannot help
                raise StoreError(
                    f"could not send {method} {_API}{path} to the service at {self.url}: {exc}"
                ) from None
            except httpx.TransportError as exc:  # refused, reset, timed out: not answered
                problem = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 300:
                    return response
                if status == 409 and _code(response) == "unknown_worker" and not presented:
                    # The service restarted (or forgot this worker): present it again, once per
                    # call, and repeat the call.
                    presented = True
                    if self._presence is not None and not path.endswith(self._presence[0]):
                        name, again = self._presence
                        await self._call("POST", f"/{name}", again)
                        continue
                if status not in _RETRIED_STATUS:
                    raise StoreError(
                        f"the service at {self.url} refused {method} {_API}{path} "
                        f"({status}): {_message(response)}"
                    )
                problem = f"{status}: {_message(response)}"
            tried += 1
            if len(self.urls) > 1:
                # Another address may answer now: try it before waiting, a round at most.
                gone = self.url
                self._at = (self._at + 1) % len(self.urls)
                log.warning(
                    "the service does not answer: moving on", url=gone, to=self.url, error=problem
                )
                presented = False  # the next one may not know this worker yet
                if tried < len(self.urls):
                    continue
            tried = 0
            now = time.monotonic()
            if began is None:
                began = now
                log.warning("the service does not answer: retrying", url=self.url, error=problem)
            elif now - began >= budget:
                raise StoreError(
                    f"the service at {self.url} has not answered for {now - began:.1f} s "
                    f"({method} {_API}{path}): {problem}"
                )
            await anyio.sleep(min(backoff(_RETRY, retry, self._rng), budget - (now - began)))
            retry += 1


def _lease(claimed: Claim) -> dict[str, Any]:
    return {"run_id": claimed.run_id, "id": claimed.id, "token": claimed.token}


def _attempt(a: Attempt) -> dict[str, Any]:
    return {name: getattr(a, name) for name in FailedAttempt.model_fields}


def _read(model: type[_M], response: httpx.Response) -> _M:
    try:
        return model.model_validate_json(response.content)
    except ValidationError as exc:
        raise StoreError(
            f"the service answered {response.request.url} with what a worker cannot read "
            f"(is it an orchestra service of this version?): {exc}"
        ) from None


def _code(response: httpx.Response) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        code = response.json().get("error")
        return code if isinstance(code, str) else None
    return None


def _message(response: httpx.Response) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        body = response.json()
        message = body.get("message") or body.get("detail")
        if message:
            return str(message)
    return response.text[:500] or response.reason_phrase
