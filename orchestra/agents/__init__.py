"""Ready-made agents to plug into an `Orchestrator`.

Installed as `orchestra.agents`, so it never shadows the top-level `agents` package of the OpenAI
Agents SDK. Simulated agents for demos and benchmarks, a CPU agent for a process pool, and Claude
agents on the official anthropic SDK (`ClaudeAgent`, with the `claude` extra; imported on first use,
so that `import orchestra.agents` does not load the SDK).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cpu import cpu_agent as cpu_agent
from .simulated import simulated as simulated

if TYPE_CHECKING:
    from .claude import PRICES as PRICES
    from .claude import BatchRequestFailed as BatchRequestFailed
    from .claude import ClaudeAccount as ClaudeAccount
    from .claude import ClaudeAgent as ClaudeAgent
    from .claude import ClaudeBatchAgent as ClaudeBatchAgent
    from .claude import ClaudeLimits as ClaudeLimits
    from .claude import ClaudePlanner as ClaudePlanner
    from .claude import ClaudeVerifier as ClaudeVerifier
    from .claude import Price as Price
    from .claude import StreamTimeout as StreamTimeout
    from .claude import StructuredOutputError as StructuredOutputError

__all__ = (
    "PRICES",
    "BatchRequestFailed",
    "ClaudeAccount",
    "ClaudeAgent",
    "ClaudeBatchAgent",
    "ClaudeLimits",
    "ClaudePlanner",
    "ClaudeVerifier",
    "Price",
    "StreamTimeout",
    "StructuredOutputError",
    "cpu_agent",
    "simulated",
)

_CLAUDE = frozenset(
    (
        "PRICES",
        "BatchRequestFailed",
        "ClaudeAccount",
        "ClaudeAgent",
        "ClaudeBatchAgent",
        "ClaudeLimits",
        "ClaudePlanner",
        "ClaudeVerifier",
        "Price",
        "StreamTimeout",
        "StructuredOutputError",
    )
)


def __getattr__(name: str) -> Any:
    # PEP 562: the anthropic SDK (34 MB, 2.5 s of import) is loaded only by who uses Claude.
    if name in _CLAUDE:
        from . import claude

        return getattr(claude, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
