"""`Background`: one coroutine that runs while its holder's ``async with`` block does.

The lease keeper, a process's presence and the listener each keep one loop going beside the code
that uses them: started on entering, cancelled and awaited on leaving. An anyio task group does
that; this holds it across `__aenter__` / `__aexit__`, which a task group's own ``async with``
cannot span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from types import TracebackType

    from anyio.abc import TaskGroup

__all__ = ("Background",)


class Background:
    """A task group entered by `start` and left by `stop`."""

    __slots__ = ("_group",)

    def __init__(self) -> None:
        self._group: TaskGroup | None = None

    async def start(self, loop: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run `loop(*args)` in the background until `stop`."""
        group = anyio.create_task_group()
        await group.__aenter__()
        group.start_soon(loop, *args)
        self._group = group

    async def stop(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Cancel the loop and wait for it; what the holder's block raised goes through the task
        group as it would through its ``async with``."""
        assert self._group is not None
        self._group.cancel_scope.cancel()
        return await self._group.__aexit__(exc_type, exc, tb)
