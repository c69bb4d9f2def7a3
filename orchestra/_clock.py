"""Time as a service: the loop's clock for in-process waits, wall time for what is persisted.

Two notions of time, never mixed:

- `Clock.now()` is the event loop's clock (monotonic seconds, meaningless outside this process). Every
  in-process wait reads it: backoff, timeouts, breaker cool-downs, rate-limit refills.
- `Clock.wall()` is epoch seconds. Whatever must survive the process — a due time, a deadline, a
  lease — is stored as wall time; `to_wall(t)` and `to_loop(w)` convert between the two, so a store
  can persist a due time computed from a backoff on the loop clock and wait for it again later.

`Clock()` is real time; `current_clock()` is the clock of the running loop. `FakeClock()` (shipped in `orchestra.testing`) is virtual time for tests:
while installed, `loop.time()` returns virtual time, and when the loop would block waiting for its
next timer, the clock jumps straight to that timer — as trio's `MockClock(autojump_threshold=0)`.
Every `asyncio.sleep`, `anyio.sleep`, cancel-scope deadline, backoff and cool-down then runs in
fake time; `wall()` advances with it, so persisted due times and leases stay consistent.

The jump is only safe when nothing can happen in the meantime. Work handed off the loop — threads
(`anyio.to_thread.run_sync`, `loop.run_in_executor`, `asyncio.to_thread`) and worker processes
(`anyio.to_process.run_sync`) — is real work in real time, so while any is in flight the clock does
not jump: the loop waits for real I/O up to its next timer, and virtual time advances at the real
pace. A thread agent taking 50 ms under a 5 s timeout succeeds; under a 10 ms timeout it times out.
It needs asyncio's default selector event loop (not uvloop).

Virtual time makes ties the rule (every attempt started at one instant times out at one instant),
so `FakeClock` also fixes their order: timers due at the same time run in the order they were set.
asyncio's own timer heap compares due times only and leaves ties to its layout, which depends on
the loop's whole history; a seeded run then would not replay in a process that ran anything before.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import time
from typing import TYPE_CHECKING, Any

import anyio.to_process
import anyio.to_thread

from ._exceptions import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from contextvars import Context
    from types import TracebackType

__all__ = ("Clock", "FakeClock", "current_clock")


class Clock:
    """Real time: `now()` is the event loop's clock (for waits), `wall()` epoch seconds (for what
    is persisted). `FakeClock` is the same service in virtual time; `current_clock()` gives the
    one that governs the running loop.

    Args:
        loop_time: the loop's clock; asyncio's loops read `time.monotonic`, the default.
    """

    __slots__ = ("_loop_time",)

    def __init__(self, loop_time: Callable[[], float] = time.monotonic) -> None:
        self._loop_time = loop_time

    def now(self) -> float:
        """The loop's time, in seconds: what every in-process wait is measured on."""
        return self._loop_time()

    def wall(self) -> float:
        """Epoch seconds: the time to persist (due times, deadlines, leases)."""
        return time.time()

    def to_wall(self, t: float) -> float:
        """The wall time at which the loop's clock reads `t`."""
        return t + (time.time() - self._loop_time())

    def to_loop(self, w: float) -> float:
        """The loop time at which the wall clock reads `w` (a persisted due time, to wait for)."""
        return w - (time.time() - self._loop_time())

    def install(self) -> None:
        """Nothing to install for real time (`FakeClock` patches the running loop)."""

    def uninstall(self) -> None:
        """Nothing to restore for real time."""


def current_clock() -> Clock:
    """The clock of the running loop: the `FakeClock` installed on it, else real time read from
    the loop's own `time()`. A store or runtime takes it once (say, when a run starts), so a test's
    `clock` fixture governs an orchestrator built without `clock=` too."""
    loop = asyncio.get_running_loop()
    # An installed FakeClock is the loop's `time` (its bound `now`): read our own patch back.
    fake = getattr(vars(loop).get("time"), "__self__", None)
    return fake if isinstance(fake, FakeClock) else Clock(loop.time)


def loop_time(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """What reads `loop`'s clock: `time.monotonic` itself when the loop's `time` is asyncio's own
    (which returns exactly that), else the loop's `time` (uvloop's, or a `FakeClock` installed on
    it). Read two or three times per task on the hot path, where the Python frame of
    `BaseEventLoop.time` costs as much as the clock it reads."""
    if "time" not in vars(loop) and type(loop).time is asyncio.BaseEventLoop.time:
        return time.monotonic
    return loop.time


class _Timer(asyncio.TimerHandle):
    """A timer ordered by its due time, then by when it was set (asyncio's: by due time alone)."""

    __slots__ = ("_order",)

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: Sequence[Any],
        loop: asyncio.AbstractEventLoop,
        context: Context | None,
        order: int,
    ) -> None:
        super().__init__(when, callback, args, loop, context)
        self._order = order

    def __lt__(self, other: asyncio.TimerHandle) -> bool:
        if isinstance(other, _Timer) and self.when() == other.when():
            return self._order < other._order
        return super().__lt__(other)


class FakeClock(Clock):
    """Virtual time for the running asyncio loop. Use `async with FakeClock():` or pass it as
    `Orchestrator(clock=FakeClock())`.

    `now()` (also `time()`) is the virtual loop time; `wall()` is the wall time when the clock was
    created, then installed, plus the virtual time elapsed since, so `wall()` moves by exactly what
    `now()` moves by (to float precision) and `to_wall` / `to_loop` are an exact constant offset.

    Args:
        autojump_threshold: real seconds the loop must be idle before time jumps (0: at once, as
            trio's autojump). Threads and worker processes need none (the clock sees them); a
            positive value helps with other real I/O, such as a socket whose peer answers later.
        start: the virtual time at install (default: the loop's own time then, so no timer
            already set moves). The loop's clock is the machine's uptime, so float rounding
            of every time computed on it differs from one host to the next; a fixed start (say a
            CI host's, 5.6e5) replays a run exactly anywhere. Timers set before the install keep
            their due times: give it on a loop with none pending (a fresh test's).
    """

    __slots__ = (
        "_held",
        "_installs",
        "_limiters",
        "_loop",
        "_now",
        "_offset",
        "_pending",
        "_saved",
        "_start",
        "autojump_threshold",
    )

    def __init__(self, *, autojump_threshold: float = 0.0, start: float | None = None) -> None:
        super().__init__()
        self.autojump_threshold = autojump_threshold
        self._start = start
        self._now = 0.0 if start is None else start
        self._offset = time.time()  # wall() - now(); set again at install
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installs = 0
        self._saved: tuple[Any, Any, float] | None = None
        self._limiters: tuple[Any, ...] = ()
        self._pending: set[asyncio.Future[Any]] = set()
        self._held = 0

    # -- the service ------------------------------------------------------------------------------

    def now(self) -> float:
        """The virtual time, in seconds (the loop's clock while installed)."""
        return self._now

    time = now

    def wall(self) -> float:
        """Virtual wall time: epoch seconds at install plus the virtual time elapsed since."""
        return self._now + self._offset

    def to_wall(self, t: float) -> float:
        return t + self._offset

    def to_loop(self, w: float) -> float:
        return w - self._offset

    # -- real work off the loop -------------------------------------------------------------------

    def in_flight(self) -> bool:
        """Whether real work is running off the loop: threads, worker processes, `real_work()`."""
        if self._held or self._pending:
            return True
        return any(limiter.borrowed_tokens for limiter in self._limiters)

    @contextlib.contextmanager
    def real_work(self) -> Iterator[None]:
        """`with clock.real_work():` — time does not jump inside, it passes at the real pace. For
        real work the clock cannot see: a thread pool of your own, `anyio.to_thread.run_sync` with
        a limiter of your own, a socket whose peer answers later."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    # -- installation -----------------------------------------------------------------------------

    def install(self) -> None:
        """Patch the running loop (idempotent: installs nest, the last `uninstall` restores)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigError(
                "FakeClock patches the running event loop: install it from async code "
                "(`async with FakeClock():`, or `Orchestrator(clock=FakeClock())`)"
            ) from None
        if self._installs:
            if loop is not self._loop:
                raise ConfigError("this FakeClock is installed on another event loop")
            self._installs += 1
            return
        selector = getattr(loop, "_selector", None)
        patched = ("time", "run_in_executor", "call_at")
        if selector is None or any(name in vars(loop) for name in patched):
            raise ConfigError(
                "FakeClock needs asyncio's default selector event loop, with no other fake clock on it"
            )
        # Virtual time starts where the loop is (no timer moves), or at `start`.
        self._now = loop.time() if self._start is None else self._start
        self._offset = time.time() - self._now
        # anyio hands work to its worker threads and processes itself (not through
        # run_in_executor), and holds a token of a CapacityLimiter while a caller waits on it (an
        # abandoned thread gives its token back): the default ones unless the caller passes its
        # own. Reading the tokens is anyio's public API; its worker registries are private.
        self._limiters = (
            anyio.to_thread.current_default_thread_limiter(),
            anyio.to_process.current_default_process_limiter(),
        )
        real_select = selector.select
        real_run_in_executor = loop.run_in_executor
        pending = self._pending
        pending.clear()

        def run_in_executor(executor: Any, func: Callable[..., Any], *args: Any) -> Any:
            future = real_run_in_executor(executor, func, *args)
            pending.add(future)
            future.add_done_callback(pending.discard)
            return future

        # asyncio runs the timers due before `time() + _clock_resolution` (1 ns). From 2**24 s on
        # (a loop time of 194 days' uptime, or a `start`), a float's step is wider than 2 ns, so
        # that sum rounds back to `time()`: a timer due exactly now never ran, and virtual time,
        # which only moves on to a later timer, stood still forever. After every select the
        # resolution is at least the step above the time, as a real clock's would be.
        base: Any = loop
        resolution = base._clock_resolution

        def select(timeout: float | None = None) -> Any:
            events = jump(timeout)
            step = math.ulp(self._now)
            base._clock_resolution = step if step > resolution else resolution
            return events

        def jump(timeout: float | None) -> Any:
            if timeout is not None and timeout <= 0:  # callbacks are ready: just poll
                return real_select(timeout)
            if self.in_flight():
                # Real work is running: wait for it (its result wakes the loop through the
                # self-pipe) up to the next timer, and let virtual time pass at the real pace.
                started = time.monotonic()
                events = real_select(timeout)
                elapsed = time.monotonic() - started
                if timeout is not None and (not events or elapsed > timeout):
                    elapsed = timeout  # land on the timer exactly, as a jump would
                self._now += elapsed
                return events
            if timeout is None:  # no timer at all: wait for real I/O
                return real_select(None)
            events = real_select(min(timeout, self.autojump_threshold))
            if not events:
                self._now += timeout  # nothing can happen before the next timer: jump there
            return events

        # asyncio's own `call_at`, line for line, but setting a `_Timer` (asyncio has no hook for
        # the timer's class; every `call_later`, `asyncio.sleep`, anyio deadline and
        # `asyncio.timeout` goes through `call_at`). With a total order, the order the heap pops
        # its timers no longer depends on its layout, which depends on when the loop last purged
        # its cancelled timers: a count that outlives a run decides that (a cancelled timer popped
        # along with a due one is never uncounted), so ties broke differently after a long run.
        order = itertools.count()

        def call_at(
            when: float, callback: Callable[..., object], *args: Any, context: Context | None = None
        ) -> asyncio.TimerHandle:
            if when is None:
                raise TypeError("when cannot be None")
            base._check_closed()
            if base._debug:
                base._check_thread()
                base._check_callback(callback, "call_at")
            timer = _Timer(when, callback, args, loop, context, next(order))
            private: Any = timer  # asyncio's own call_at, from here on
            if private._source_traceback:
                del private._source_traceback[-1]
            heapq.heappush(base._scheduled, timer)
            private._scheduled = True
            return timer

        self._saved = (selector, real_select, resolution)
        selector.select = select
        loop.time = self.now  # type: ignore[method-assign]
        loop.run_in_executor = run_in_executor  # type: ignore[method-assign,assignment]
        loop.call_at = call_at  # type: ignore[method-assign,assignment]
        self._loop = loop
        self._installs = 1

    def uninstall(self) -> None:
        if not self._installs:
            return
        self._installs -= 1
        if self._installs:
            return
        assert self._saved is not None
        assert self._loop is not None
        selector, real_select, resolution = self._saved
        selector.select = real_select
        loop: Any = self._loop
        loop._clock_resolution = resolution
        del loop.time  # back to the class's methods
        del loop.run_in_executor
        del loop.call_at
        # Timers still pending (a background task's sleep, on a loop that outlives the clock: a
        # module-scoped pytest-asyncio loop) keep what is left of their delay, now in real time:
        # left at their virtual due time, a sleep set an hour of virtual time ahead of the real
        # clock would wait an hour. (A deadline kept elsewhere, such as an anyio cancel scope's,
        # is re-armed at that virtual time: leave a clock's block before leaving its scopes.)
        shift = loop.time() - self._now
        for timer in loop._scheduled:
            timer._when += shift
        heapq.heapify(loop._scheduled)  # a uniform shift keeps the order, up to rounding
        self._loop = None
        self._saved = None
        self._limiters = ()
        self._pending.clear()

    async def __aenter__(self) -> FakeClock:
        self.install()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.uninstall()
