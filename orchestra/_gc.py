"""Keeping the cyclic garbage collector off a run's own records.

Admitting a large batch allocates a record per task, and building a large run's result a few
objects per task; all of them survive the step. Left on, the collector would walk them again and
again while they are built (each young collection promotes them, and every tenth walks the older
ones too), which costs as much as the step itself: measured, the end of a 100,000-task run spent
0.9 µs per task in collections that freed nothing. It is paused for such a step (which runs no
user code but a payload validator or an aggregator) and restored right after.

What an admission allocated would then be walked once more, by the next young collection (0.2 µs
per task, a twentieth of a no-op task's whole cost), and again by each older one while the run
lasts, though it stays alive until the run ends. While a run is under way it is frozen instead
(`gc.freeze`: moved, in O(1), out of the collector's sight) and handed back when the last run
of the process ends (`gc.unfreeze`, O(1): into the oldest generation). Only when nothing else
in the process froze objects (an application that freezes before forking keeps its own): what
this module did not freeze, it never unfreezes (unless the application freezes objects while a
run is under way: they are handed back with the run's at its end). Freezing takes the application's young objects
along for the run's length; their reference counts still free them, and a garbage cycle among
them waits for the run's end to be collected. Only what lives as long as the run is frozen: a
whole list's admission, a large batch of spawns; a streamed run forgets its records as they end,
and its chunks are not frozen (nor, with them, what the application allocated meanwhile).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ("LARGE", "paused", "running")

LARGE: Final = 1_000  # steps over at least this many tasks pause the collector

_runs = 0  # runs under way in this process (see `running`)
_may_freeze = False  # nothing else had frozen objects when the first of them started
_froze = False  # `paused` froze objects that the end of the last run unfreezes


@contextmanager
def running() -> Iterator[None]:
    """A run is under way: what `paused(..., keep=True)` steps allocate stays frozen until the
    last run of the process ends."""
    global _runs, _froze, _may_freeze
    if not _runs:
        # Asked once, when the first run starts: `get_freeze_count` walks every frozen object.
        _may_freeze = not gc.get_freeze_count()
    _runs += 1
    try:
        yield
    finally:
        _runs -= 1
        if not _runs and _froze:
            _froze = False
            gc.unfreeze()


@contextmanager
def paused(size: int, keep: bool = False) -> Iterator[None]:
    """Pause the cyclic GC for the block when `size` is at least `LARGE` (and it is on); with
    `keep`, what the block allocated lives as long as the run: frozen, if a run is under way
    and no one else froze anything."""
    global _froze
    pause = size >= LARGE and gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause:
            if keep and _runs and _may_freeze:
                gc.freeze()
                _froze = True
            gc.enable()
