"""A task as JSON gives it: `TaskSpec`, the keyword arguments of `Task`, checked once at the
boundary (an ``orchestra run`` input line, a run submitted to the service)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pydantic

from ._task import Task

__all__ = ("JsonValue", "TaskSpec")


def _finite(value: Any) -> Any:
    """`value`, refused when it holds NaN or an infinity: Python's `json` reads ``NaN`` and
    ``Infinity``, which JSON has not, and a store would keep them as null or refuse them after
    the run was accepted."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is float and not math.isfinite(item):
            raise ValueError(f"{item} is not a JSON number (JSON has no NaN nor Infinity)")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


JsonValue = Annotated[Any, pydantic.AfterValidator(_finite)]
"""Any value JSON holds: what `json.loads` gave, NaN and the infinities refused."""


class TaskSpec(pydantic.BaseModel):
    """One task as JSON gives it: the keyword arguments of `Task`."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    kind: str
    payload: JsonValue = None
    id: str | None = None
    priority: int = 0
    depends_on: list[str] = []
    depends_on_tags: list[str] = []
    tags: list[str] = []
    key: str | None = None
    timeout: float | None = pydantic.Field(default=None, gt=0)
    critical: bool = False
    metadata: dict[str, JsonValue] | None = None

    def task(self) -> Task:
        fields = self.model_dump(exclude={"kind", "payload"})
        return Task(self.kind, self.payload, **fields)
