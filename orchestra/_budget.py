"""A run's spending budget: `Orchestrator(max_cost=..., max_tokens=...)`.

Spend is what agents report through `ctx.record_usage` (a Claude agent reports every answer's
usage and cost, failed attempts too). The budget is checked only when usage is recorded, so a run
without one, or whose agents report nothing, pays nothing for it. When the spend reaches the budget
no new attempt starts: the attempts in flight are cancelled (their spend so far is counted), every
unfinished task ends cancelled with ``error_type="BudgetExceeded"``, and the run ends "partial" or
"failed" by its success threshold, with `metadata.reason` naming the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._config import check_int, check_number

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ("BUDGET_EXCEEDED", "Budget")

BUDGET_EXCEEDED = "BudgetExceeded"
"""The `error_type` of the tasks a spent budget ended."""


class Budget:
    """The most a run may spend: USD (`max_cost`) and tokens of every kind together (`max_tokens`).

    Reached when the spend is at or over a limit: the next attempt would exceed it."""

    __slots__ = ("max_cost", "max_tokens")

    def __init__(self, *, max_cost: float | None = None, max_tokens: int | None = None) -> None:
        check_number("max_cost", max_cost, positive=True, optional=True)
        check_int("max_tokens", max_tokens, optional=True)
        self.max_cost = max_cost
        self.max_tokens = max_tokens

    @classmethod
    def of(cls, *, max_cost: float | None, max_tokens: int | None) -> Budget | None:
        """The budget of these limits, or None when there is none (nothing to check)."""
        if max_cost is None and max_tokens is None:
            return None
        return cls(max_cost=max_cost, max_tokens=max_tokens)

    def reached(self, cost: float, tokens: Mapping[str, int]) -> str | None:
        """Why no new attempt may start, or None while there is room."""
        if self.max_cost is not None and cost >= self.max_cost:
            return f"the budget of max_cost={self.max_cost:g} USD is spent (${cost:.4f})"
        if self.max_tokens is not None:
            used = sum(tokens.values())
            if used >= self.max_tokens:
                return f"the budget of max_tokens={self.max_tokens} is spent ({used} tokens)"
        return None

    def __repr__(self) -> str:
        return f"Budget(max_cost={self.max_cost!r}, max_tokens={self.max_tokens!r})"
