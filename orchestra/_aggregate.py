"""Aggregators fold task results into `RunResult.data` as they arrive.

An aggregator is a factory: `begin()` gives a fresh accumulator for one run, whose `add(result)` is
called for every succeeded task as it finishes and `finish()` returns the data. The built-ins give the
same data whatever the completion order: they fold at the end in admission order, or, where the fold
is order-free (count, max, min, exact sums), as results arrive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ._config import check_mapping, shown
from ._exceptions import ConfigError

if TYPE_CHECKING:
    from ._task import TaskResult

__all__ = (
    "Accumulator",
    "Aggregator",
    "ByKind",
    "Collect",
    "Discard",
    "Merge",
    "Reduce",
    "Transform",
)


class Accumulator(Protocol):
    def add(self, result: TaskResult) -> None: ...
    def finish(self) -> Any: ...


class Aggregator(Protocol):
    """Anything with `begin() -> Accumulator`."""

    def begin(self) -> Accumulator: ...


class Ordered:
    """Keeps the results; `ordered()` gives (id, output) in input order, once, at the end."""

    __slots__ = ("items", "sorted")

    def __init__(self) -> None:
        self.items: list[TaskResult] = []
        self.sorted = False

    def add(self, result: TaskResult) -> None:
        self.items.append(result)

    def in_order(self, results: list[TaskResult]) -> None:
        """Every result, in input order already (a whole-list run's successes, from its store):
        they replace `items`, and `sort` has nothing to do."""
        self.items = results
        self.sorted = True

    def sort(self) -> list[TaskResult]:
        """The results in input order (sorted in place, once, at the end)."""
        items = self.items
        if self.sorted:
            return items
        if items and getattr(items[0], "rank", -1) >= 0:
            # The store ranked every result of the run in input order (a whole-list run): an int
            # key, read in C, instead of a position tuple built per result.
            items.sort(key=_rank)
        else:
            items.sort(key=_order)
        return items

    def ordered(self) -> list[tuple[str, Any]]:
        """(id, output) of each result, in input order."""
        return [(result.task_id, result.output) for result in self.sort()]


_rank = attrgetter("rank")
_order = attrgetter("order")


class Collect:
    """Default: `data` maps each succeeded task's id to its output, in admission order."""

    def begin(self) -> Accumulator:
        return _CollectAcc()


class _CollectAcc(Ordered):
    __slots__ = ()

    def finish(self) -> dict[str, Any]:
        # A comprehension: no tuple per result (an allocation the cyclic GC would track at a
        # million), and an attribute read in it is a specialised instruction, twice as fast as
        # `dict(zip(map(attrgetter(...), ...)))` (60 ns a result against 110, measured).
        return {result.task_id: result.output for result in self.sort()}


class Discard:
    """Keep no outputs (`data` is the count of succeeded tasks): for runs of millions of tasks."""

    def begin(self) -> Accumulator:
        return _DiscardAcc()


class _DiscardAcc:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def add(self, result: TaskResult) -> None:
        self.n += 1

    def finish(self) -> int:
        return self.n


class Merge:
    """Concatenate list outputs into one list (a non-list output counts as one item).

    Args:
        dedupe: drop repeated items, keeping the first (by `key` when given, else by value).
        key: the identity of an item for de-duplication, e.g. ``lambda c: c["id"]``.
        sort_by: sort the merged list by this key (stable; admission order breaks ties).
    """

    def __init__(
        self,
        *,
        dedupe: bool = False,
        key: Callable[[Any], Hashable] | None = None,
        sort_by: Callable[[Any], Any] | None = None,
    ) -> None:
        self.dedupe = dedupe
        self.key = key
        self.sort_by = sort_by

    def begin(self) -> Accumulator:
        return _MergeAcc(self)


class _MergeAcc(Ordered):
    __slots__ = ("spec",)

    def __init__(self, spec: Merge) -> None:
        super().__init__()
        self.spec = spec

    def finish(self) -> list[Any]:
        merged: list[Any] = []
        for _, output in self.ordered():
            if isinstance(output, list | tuple):
                merged.extend(output)
            elif output is not None:
                merged.append(output)
        spec = self.spec
        if spec.dedupe:
            key = spec.key or _identity
            seen: set[Hashable] = set()
            unique = []
            for item in merged:
                k = key(item)
                if k not in seen:
                    seen.add(k)
                    unique.append(item)
            merged = unique
        if spec.sort_by is not None:
            merged.sort(key=spec.sort_by)
        return merged


def _identity(item: Any) -> Hashable:
    return item if isinstance(item, Hashable) else repr(item)


Builtin = Literal["sum", "mean", "max", "min", "count"]


class Reduce:
    """Fold outputs into one value.

    `Reduce("sum" | "mean" | "max" | "min" | "count")`, or `Reduce(fn, initial)` with
    ``fn(accumulated, output) -> accumulated``, folded in admission order at the end (so `fn` need not
    be commutative). `select` picks the value out of each output (default: the output itself).
    Sums are exact (`math.fsum`'s algorithm, kept incrementally), so order never changes them.
    """

    def __init__(
        self,
        fn: Builtin | Callable[[Any, Any], Any],
        initial: Any = None,
        *,
        select: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(fn, str) and fn not in ("sum", "mean", "max", "min", "count"):
            raise ConfigError(
                f"Reduce: unknown reducer {fn!r}; use sum, mean, max, min, count or a function"
            )
        self.fn = fn
        self.initial = initial
        self.select = select

    def begin(self) -> Accumulator:
        if isinstance(self.fn, str):
            return _BuiltinReduce(self.fn, self.select)
        return _FnReduce(self.fn, self.initial, self.select)


class _BuiltinReduce:
    __slots__ = ("best", "fn", "ints", "n", "partials", "select")

    def __init__(self, fn: str, select: Callable[[Any], Any] | None) -> None:
        self.fn = fn
        self.select = select
        self.n = 0
        self.partials: list[float] = []
        self.ints: int | None = 0  # the sum while every value is an int (exact, and an int)
        self.best: Any = None

    def add(self, result: TaskResult) -> None:
        value = result.output if self.select is None else self.select(result.output)
        self.n += 1
        fn = self.fn
        if fn in ("sum", "mean"):
            if self.ints is not None:
                if type(value) is int:
                    self.ints += value
                    return
                _add_number(self.partials, self.ints)  # the ints so far
                self.ints = None
            _add_number(self.partials, value)
        elif fn == "max":
            if self.best is None or value > self.best:
                self.best = value
        elif fn == "min" and (self.best is None or value < self.best):
            self.best = value

    def finish(self) -> Any:
        if self.fn == "count":
            return self.n
        if self.fn == "sum":
            return self.ints if self.ints is not None else math.fsum(self.partials)
        if self.fn == "mean":
            if not self.n:
                return None
            return (
                self.ints / self.n if self.ints is not None else math.fsum(self.partials) / self.n
            )
        return self.best


def _add_number(partials: list[float], x: float) -> None:
    """`_add_exact`, for an int too: one float may not hold it, so its exact float parts."""
    if type(x) is not int:
        _add_exact(partials, x)
        return
    while x:
        part = float(x)
        _add_exact(partials, part)
        x -= int(part)


def _add_exact(partials: list[float], x: float) -> None:
    # Shewchuk's algorithm, as in the `math.fsum` recipe: `partials` holds the exact sum as
    # non-overlapping floats, so the total does not depend on the order of additions.
    i = 0
    for y in partials:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            partials[i] = lo
            i += 1
        x = hi
    partials[i:] = [x]


class _FnReduce(Ordered):
    __slots__ = ("fn", "initial", "select")

    def __init__(
        self, fn: Callable[[Any, Any], Any], initial: Any, select: Callable[[Any], Any] | None
    ) -> None:
        super().__init__()
        self.fn = fn
        self.initial = initial
        self.select = select

    def finish(self) -> Any:
        acc = self.initial
        select = self.select
        for _, output in self.ordered():
            acc = self.fn(acc, output if select is None else select(output))
        return acc


class Transform:
    """Apply `fn` to each output, then fold with `then` (default `Collect()`)."""

    def __init__(self, fn: Callable[[Any], Any], then: Aggregator | None = None) -> None:
        self.fn = fn
        self.then = then or Collect()

    def begin(self) -> Accumulator:
        return _TransformAcc(self.fn, self.then.begin())


class _TransformAcc:
    __slots__ = ("fn", "inner")

    def __init__(self, fn: Callable[[Any], Any], inner: Accumulator) -> None:
        self.fn = fn
        self.inner = inner

    def add(self, result: TaskResult) -> None:
        self.inner.add(_Mapped(result, self.fn(result.output)))  # type: ignore[arg-type]

    def finish(self) -> Any:
        return self.inner.finish()


class _Mapped:
    """A result seen through a transform: its own output, everything else the original's."""

    __slots__ = ("_result", "output")

    def __init__(self, result: TaskResult, output: Any) -> None:
        self._result = result
        self.output = output

    def __getattr__(self, name: str) -> Any:
        return getattr(self._result, name)


class ByKind:
    """One aggregator per kind: `data` maps each kind to its own folded data.

    Kinds without an entry use `default` (`Collect()`). Every mapped kind has an entry in `data`,
    even when none of its tasks succeeded.
    """

    def __init__(
        self, by_kind: Mapping[str, Aggregator], default: Aggregator | None = None
    ) -> None:
        _check_by_kind("ByKind", by_kind)
        if default is not None and not _is_aggregator(default):
            raise ConfigError(
                f"ByKind default={shown(default)} is not an aggregator (it needs begin())"
            )
        self.by_kind = dict(by_kind)
        self.default = default if default is not None else Collect()

    def begin(self) -> Accumulator:
        return _ByKindAcc(self)


class _ByKindAcc:
    __slots__ = ("accs", "spec")

    def __init__(self, spec: ByKind) -> None:
        self.spec = spec
        self.accs: dict[str, Accumulator] = {}

    def add(self, result: TaskResult) -> None:
        acc = self.accs.get(result.kind)
        if acc is None:
            agg = self.spec.by_kind.get(result.kind, self.spec.default)
            acc = self.accs[result.kind] = agg.begin()
        acc.add(result)

    def finish(self) -> dict[str, Any]:
        for kind, agg in self.spec.by_kind.items():  # a mapped kind with no success still has data
            if kind not in self.accs:
                self.accs[kind] = agg.begin()
        return {kind: acc.finish() for kind, acc in sorted(self.accs.items())}


def aggregator_of(value: Aggregator | Mapping[str, Aggregator] | None) -> Aggregator:
    """Accept an aggregator, a mapping kind → aggregator (`ByKind`), or None (`Collect`)."""
    if value is None:
        return Collect()
    if isinstance(value, Mapping):
        _check_by_kind("aggregate", value)
        return ByKind(value)
    if not _is_aggregator(value):
        raise ConfigError(f"aggregate={shown(value)} is not an aggregator (it needs begin())")
    return value


def _is_aggregator(value: Any) -> bool:
    return callable(getattr(value, "begin", None))


def _check_by_kind(name: str, by_kind: Any) -> None:
    """Kinds (strings) to aggregators, checked when configured: a wrong value would otherwise
    fail only at the run's first result, leaving `data` None."""
    check_mapping(name, by_kind, optional=False)
    for kind, agg in by_kind.items():
        if not _is_aggregator(agg):
            raise ConfigError(
                f"{name}[{kind!r}]={shown(agg)} is not an aggregator (it needs begin())"
            )


def percentile(sorted_values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in [0, 1])."""
    values = list(sorted_values)
    if not values:
        return 0.0
    rank = max(0, math.ceil(q * len(values)) - 1)
    return values[rank]
