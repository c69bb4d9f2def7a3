"""Ready-made agents to plug into an `Orchestrator`.

Installed as `orchestra.agents`, so it never shadows the top-level `agents` package of the OpenAI
Agents SDK. Claude agents (worker, planner, verifier) and an HTTP agent come with later releases;
for now: simulated agents for demos and benchmarks, and a CPU agent for a process pool.
"""

from .cpu import cpu_agent as cpu_agent
from .simulated import simulated as simulated

__all__ = ("cpu_agent", "simulated")
