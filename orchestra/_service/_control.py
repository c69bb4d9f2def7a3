"""Control of a live run, by name: what the control routes do to a `RunHandle` (pause, resume,
cancel, stop, reprioritize, and its status), as one function of the operation's name and its JSON
arguments, answering JSON.

One function for both paths a control request takes: the replica that runs the run acts on it at
once; one that does not passes the request through the database to the one that does
(`_replicas.py`), which acts on it here, and the answer goes back as it is (the same JSON, the same
refusals).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .._exceptions import ConfigError, InputError
from ._errors import Refused
from ._models import Cancelled, CancelRequest, Control, StatusOut, StopRequest

if TYPE_CHECKING:
    from .._core._handle import RunHandle

__all__ = ("OPS", "act")

OPS: Final = frozenset({"pause", "resume", "cancel", "stop", "reprioritize", "status"})
"""The operations `act` knows."""


async def act(handle: RunHandle, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Do `op` to the run of `handle` with `args` (the request's JSON body, checked): its answer as
    JSON. Bad arguments (a cancel selector the run refuses) are a `Refused` 400."""
    try:
        return await _act(handle, op, args)
    except (InputError, ConfigError) as exc:
        field = getattr(exc, "field", None)
        raise Refused(
            400, "invalid", str(exc), field=field if isinstance(field, str) else None
        ) from None


async def _act(handle: RunHandle, op: str, args: dict[str, Any]) -> dict[str, Any]:
    run_id = handle.run_id
    if op == "pause":
        handle.pause()
        return Control(run_id=run_id, paused=handle.paused).model_dump()
    if op == "resume":
        handle.resume()
        return Control(run_id=run_id, paused=handle.paused).model_dump()
    if op == "cancel":
        body = CancelRequest.model_validate(args)
        done = handle.cancel(
            task_id=body.task_id,
            kind=body.kind,
            tag=body.tag,
            agent=body.agent,
            priority=body.priority,
            reason=body.reason,
        )
        return Cancelled(
            reason=done.reason,
            cancelled=list(done.cancelled),
            skipped=list(done.skipped),
            deferred=done.deferred,
        ).model_dump()
    if op == "stop":
        stop = StopRequest.model_validate(args)
        result = await handle.stop(stop.grace, reason=stop.reason)
        return result.model_dump(mode="json")
    if op == "reprioritize":
        return {"changed": handle.reprioritize(str(args["task_id"]), int(args["priority"]))}
    if op == "status":
        return StatusOut.model_validate(handle.status().to_dict()).model_dump(mode="json")
    raise AssertionError(f"unknown control operation {op!r}")  # pragma: no cover
