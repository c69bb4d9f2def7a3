"""Task durations in bounded memory: `Durations`, the exact count, mean and max of one kind's
durations and a uniform sample of them for percentiles (the report keeps one per kind)."""

from __future__ import annotations

import math
from random import Random

__all__ = ("Durations",)


class Durations:
    """Task durations of one kind in bounded memory: exact count, mean and max, and percentiles
    from a uniform sample of at most `SAMPLE` durations (exact while there are no more than that).

    The sample is a reservoir kept by Li's algorithm L, which draws random numbers only for the
    values it keeps (a few thousand for a million tasks), seeded so a run's report is reproducible.
    """

    SAMPLE = 4096
    __slots__ = ("count", "max", "next", "rng", "sample", "total", "weight")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.sample: list[float] = []
        self.rng: Random | None = None
        self.weight = 1.0
        self.next = 0  # the count at which the next value enters the sample (once it is full)

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        if self.count <= self.SAMPLE:
            self.sample.append(value)
            if self.count == self.SAMPLE:
                self.rng = Random(self.SAMPLE)
                self._skip()
            return
        if self.count == self.next:
            self.sample[self.rng.randrange(self.SAMPLE)] = value  # type: ignore[union-attr]
            self._skip()

    def extend(self, values: list[float]) -> None:
        """`add` each of `values`: the exact figures in C (sum, max), the sample as `add` keeps it."""
        if not values:
            return
        if not self.count and len(values) > self.SAMPLE:
            # All at once (a whole-list run's durations, at its end): a uniform sample drawn in
            # one go, and the reservoir's state as algorithm L would have left it: the largest key
            # of a kept value is the k-th smallest of n uniform keys, Beta(k, n - k + 1)
            # distributed. (Walking algorithm L over the values costs ~0.3 µs each.)
            n, k = len(values), self.SAMPLE
            first = self.rng = Random(k)
            self.count = n
            self.total = sum(values)
            self.max = max(values)
            self.sample = first.sample(values, k)
            self.weight = first.betavariate(k, n - k + 1)
            self.next = n + int(math.log(first.random() or 1e-300) / math.log1p(-self.weight)) + 1
            return
        room = self.SAMPLE - self.count
        head, rest = (values[:room], values[room:]) if room > 0 else ([], values)
        if head:  # what `add` does for each, in C
            self.count += len(head)
            self.total += sum(head)
            top = max(head)
            if top > self.max:
                self.max = top
            self.sample.extend(head)
            if self.count == self.SAMPLE:
                self.rng = Random(self.SAMPLE)
                self._skip()
        if not rest:
            return
        self.total += sum(rest)
        top = max(rest)
        if top > self.max:
            self.max = top
        start = self.count
        self.count += len(rest)
        # Algorithm L over the rest: only the values that enter the sample are looked at.
        rng: Random = self.rng  # type: ignore[assignment]
        while self.next <= self.count:
            self.sample[rng.randrange(self.SAMPLE)] = rest[self.next - start - 1]
            self._skip_from(self.next)

    def _skip(self) -> None:
        self._skip_from(self.count)

    def _skip_from(self, count: int) -> None:
        rng: Random = self.rng  # type: ignore[assignment]
        self.weight *= math.exp(math.log(rng.random() or 1e-300) / self.SAMPLE)
        gap = math.log(rng.random() or 1e-300) / math.log1p(-self.weight)
        self.next = count + int(gap) + 1
