"""Remediation: the suggestion an error record gives the user, from what went wrong with its task."""

from __future__ import annotations

import re

from .._task import CANCELLED, SKIPPED

__all__ = ("remediation",)

# A 401 an agent reports in its own words (an HTTP client's message, a PermanentError of its own).
_HTTP_401 = re.compile(r"\b401\b|\bunauthori[sz]ed\b", re.IGNORECASE)


def remediation(
    status: str,
    error_type: str,
    message: str,
    *,
    agents: int = 1,
    status_code: int | None = None,
    api_error_type: str | None = None,
) -> str:
    """A suggestion for the user, from what went wrong: `agents` is how many agents the task was
    tried on (a fallback is advised only when it had none), `status_code` and `api_error_type`
    the last attempt's HTTP error, if it was one."""
    if status == SKIPPED:
        return f"Fix what failed first ({message}); this task runs once its dependencies succeed."
    if status == CANCELLED:
        if error_type == "RunTimeout":
            return (
                "The run ended before this task finished: raise the run timeout, or run it again."
            )
        if error_type == "BudgetExceeded":
            return "The run's budget (max_cost / max_tokens) was spent before this task finished: raise it, or run the rest again."
        if error_type == "Stopped":
            return "The run was stopped before this task finished: run it again to finish it."
        return "It was cancelled (see metadata.reason and metadata.cancellations): run it again if it is still wanted."
    lowered = message.lower()
    if error_type == "TaskTimeout":
        return "Raise the task's timeout, lower its attempts or backoff, or speed up its agents."
    if error_type == "AttemptTimeout":
        return "Raise the attempt timeout (timeouts={'attempt': ...} or @agent(timeout=...)) or check the agent's latency."
    if error_type == "Rejected":
        return "The safety check refused this task: change its payload or the check."
    if error_type == "VerificationError":
        return "The output kept failing verification: improve the agent or its prompt, or relax the verifier."
    if error_type == "InvalidOutput":
        return "The agent returned what a result cannot hold: fix the agent as the message says (an `await`; for a store that keeps outputs as JSON, a JSON value)."
    if error_type == "InputError":
        return "The task (or a task it spawned) is invalid: fix it as the message says; retrying will not help."
    if (
        status_code == 401
        or api_error_type == "authentication_error"
        or error_type == "AuthenticationError"
        or _HTTP_401.search(message)
    ):
        return "The API rejected the credentials (HTTP 401): check the API key the agent uses (ANTHROPIC_API_KEY for Claude agents); retrying will not help."
    if status_code == 403 or api_error_type == "permission_error":
        return "The API key is not allowed to do this (HTTP 403): check the key's permissions and the model it may use; retrying will not help."
    if "429" in message or "rate limit" in lowered:
        return "The agent is rate limited: lower concurrency or the agent's limit, or raise your API quota."
    if error_type in ("ValidationError", "PermanentError") or "400" in message:
        return "The request is invalid for this agent: fix the payload; retrying will not help."
    if error_type == "CircuitOpen":
        fallback = " add a fallback agent for this kind," if agents <= 1 else ""
        return f"The agent was down (its circuit breaker open) through every attempt: check the service behind it,{fallback} or raise max_attempts to wait longer for it."
    if error_type == "NoAgentLeft":
        return (
            "No agent of the chain could take the task: add an agent for this kind or a fallback."
        )
    if agents > 1:
        return "Every agent of its chain failed: check the last agent's error above and the earlier attempts, or raise max_attempts."
    return (
        "Add a fallback agent for this kind, raise max_attempts, or check the agent's error above."
    )
