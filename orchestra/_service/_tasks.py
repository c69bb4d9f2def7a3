"""The seed's minimal API: one task, no run to manage (``POST /tasks``, ``GET /tasks/{id}``).

The task runs in a run of its own, ``task-<task id>``, so that it is kept, listed and read like
any run, and a second ``POST`` of the same task id answers the same task (never a second run).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Response

from .._exceptions import InputError
from .._spec import TaskSpec
from ._auth import require
from ._errors import Refused, responses
from ._models import TaskAccepted, TaskOutcome
from ._runs import ServiceDep

__all__ = ("router",)

router = APIRouter(prefix="/tasks", tags=["tasks"])

_ENDS = frozenset({"succeeded", "failed", "skipped", "cancelled"})
TaskPath = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]


def run_of(task_id: str) -> str:
    return f"task-{task_id}"


@router.post(
    "",
    status_code=202,
    response_model=TaskAccepted,
    dependencies=[Depends(require("submit"))],
    responses={
        200: {"model": TaskAccepted, "description": "The task of this id, submitted before."},
        **responses(400, 401, 403, 413),
    },
)
async def submit_task(spec: TaskSpec, service: ServiceDep, response: Response) -> TaskAccepted:
    """Run one task (the shape ``orchestra run`` reads) in a run of its own; its id (given, or a
    fresh one) reads it back."""
    task_id = spec.id or uuid.uuid4().hex[:12]
    if len(task_id) > 200 or not all(c.isalnum() or c in "._:-" for c in task_id):
        raise Refused(
            400,
            "invalid",
            f"a task submitted alone is read back by its id in a URL: give an id of letters, "
            f"digits and ._:- (at most 200), not {task_id[:80]!r}",
            field="id",
        )
    spec = spec.model_copy(update={"id": task_id})
    _, created = await service.submit(tasks=[spec], input=None, run_id=run_of(task_id), key=None)
    if not created:
        response.status_code = 200
    return TaskAccepted(task_id=task_id, run_id=run_of(task_id))


@router.get(
    "/{task_id}",
    response_model=TaskOutcome,
    dependencies=[Depends(require("read"))],
    responses=responses(401, 403, 404),
)
async def get_task(task_id: TaskPath, service: ServiceDep) -> TaskOutcome:
    """The task's state: running until it ends, then its output (or its error)."""
    run_id = run_of(task_id)
    try:
        events = await service.read(service.store.events, run_id, task_id)
    except InputError:
        if service.handle(run_id) is None:
            raise Refused(
                404, "not_found", f"no task {task_id!r} was submitted alone", field="task_id"
            ) from None
        events = []  # submitted here, its rows not written yet
    ended = [e for e in events if e["event"] in _ENDS]
    outcome = TaskOutcome(
        task_id=task_id, run_id=run_id, status=ended[-1]["event"] if ended else "running"
    )
    handle = service.handle(run_id)
    result = handle.result if handle is not None and handle.done else None
    if result is not None:
        error = result.error_for(task_id)
        if error is not None:
            outcome.status = error.status
            outcome.error_type = error.error_type
            outcome.error = error.message
        else:
            data: Any = result.data
            outcome.status = "succeeded"
            outcome.output = data.get(task_id) if isinstance(data, dict) else data
    elif ended:
        outcome.error = ended[-1].get("detail")
    return outcome
