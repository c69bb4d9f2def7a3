"""Claude agents on the official anthropic SDK (the `claude` extra: ``pip install 'orchestra-runtime[claude]'``).

```python
from orchestra.agents.claude import ClaudeAgent

research = ClaudeAgent(name="research", kinds=["research"], model="claude-sonnet-4-5",
                       system="You assess contract clauses.", prompt="Clause: {payload[text]}",
                       output=ClauseRisk)
```

The agents and what they share, one module each, imported here (the dependency runs one way,
from this module down): `ClaudeAgent` (`_claude_agent`), built on by `ClaudeBatchAgent`
(`_claude_batch`, the Message Batches API), `ClaudePlanner` (`_claude_planner`, a decomposer) and
`ClaudeVerifier` (`_claude_verifier`); the planner's and the verifier's calls outside an attempt
(`_claude_calls`); the API key's `ClaudeAccount` (`_claude_account`), its `ClaudeLimits`
(`_claude_limits`) and the price table (`_claude_prices`).
"""

from __future__ import annotations

from .._extras import missing_extra

try:
    # The extra, checked before the modules below import from it: the SDK down to the newest
    # part of it they use (the schema of structured outputs, as `messages.parse` sends it).
    import anthropic.lib._parse._transform  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise missing_extra("orchestra's Claude agents", "claude", exc) from exc

from ._claude_account import ClaudeAccount
from ._claude_agent import ClaudeAgent, StreamTimeout, StructuredOutputError
from ._claude_batch import BatchRequestFailed, ClaudeBatchAgent
from ._claude_limits import ClaudeLimits, model_family
from ._claude_planner import ClaudePlanner
from ._claude_prices import PRICES, Price
from ._claude_verifier import ClaudeVerifier

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
    "model_family",
)
