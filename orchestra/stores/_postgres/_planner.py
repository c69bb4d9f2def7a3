"""The planner's statistics of `orchestra.tasks`, kept up with the input a coordinator admits.

A run's admission grows the tasks table by thousands of rows in seconds, long before autovacuum
looks at it (its naptime is a minute). Until then the planner takes the table for what it last
measured (nothing, for a new database) and plans the hot statements for that size: a batch of
completions joined to the table by scanning all of it, and the coordinator's read of the ended
feed likewise, five times the cost per task of the plans the real size gets (measured with
pg_stat_statements on 50,000 tasks and two workers). So a coordinator that admitted a fifth of
the table's measured size since its last look (and at least `THRESHOLD` tasks) has it measured
again at once, as autovacuum's own rule would, only sooner. The prepared statements of every
connection are planned again after it (an ANALYZE invalidates them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncpg

__all__ = ("THRESHOLD", "Growth")

THRESHOLD: Final = 1_000
"""Tasks admitted at the least before the table is measured again."""
SHARE: Final = 0.2
"""The part of the table's measured size admitted before it is measured again."""


class Growth:
    """The tasks one coordinator admitted since it last had the table measured."""

    __slots__ = ("admitted",)

    def __init__(self) -> None:
        self.admitted = 0

    async def admit(self, conn: asyncpg.Connection, n: int) -> None:
        """Count `n` tasks admitted (committed); measure the table when they grew it enough.
        Outside any transaction: the ANALYZE commits on its own."""
        self.admitted += n
        if self.admitted < THRESHOLD:
            return
        rows = await conn.fetchval(
            "SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = 'orchestra.tasks'::regclass"
        )
        if self.admitted < SHARE * float(rows or 0):
            return
        self.admitted = 0
        # SKIP_LOCKED: another coordinator (or autovacuum) measuring it now is as good.
        await conn.execute("ANALYZE (SKIP_LOCKED) orchestra.tasks")
