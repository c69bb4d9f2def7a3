"""A task as JSON gives it: `TaskSpec`, the keyword arguments of `Task`, checked once at the
boundary (an ``orchestra run`` input line, a run submitted to the service)."""

from __future__ import annotations

from typing import Any

import pydantic

from ._task import Task

__all__ = ("TaskSpec",)


class TaskSpec(pydantic.BaseModel):
    """One task as JSON gives it: the keyword arguments of `Task`."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)

    kind: str
    payload: Any = None
    id: str | None = None
    priority: int = 0
    depends_on: list[str] = []
    depends_on_tags: list[str] = []
    tags: list[str] = []
    key: str | None = None
    timeout: float | None = pydantic.Field(default=None, gt=0)
    critical: bool = False
    metadata: dict[str, Any] | None = None

    def task(self) -> Task:
        fields = self.model_dump(exclude={"kind", "payload"})
        return Task(self.kind, self.payload, **fields)
