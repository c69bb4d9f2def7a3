"""The error for an optional dependency that is not installed: the extra that brings it.

Every optional import of the package (`orchestra.agents.claude`, `orchestra.metrics`,
`orchestra.tracing`, the command, the live view) raises `missing_extra(...)`, so the message
names the distribution's real name, ``orchestra-runtime`` (``orchestra`` on the package index
is an unrelated project), and ``except ImportError`` catches it.
"""

from __future__ import annotations

from typing import Final

__all__ = ("DISTRIBUTION", "install_hint", "missing_extra")

DISTRIBUTION: Final = "orchestra-runtime"
"""The name orchestra is published under (the import name stays `orchestra`)."""


def install_hint(extra: str) -> str:
    """The command that installs `extra`: ``pip install 'orchestra-runtime[extra]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing_extra(feature: str, extra: str, cause: ImportError) -> ModuleNotFoundError:
    """The error to raise (``from cause``) when `feature` cannot import what `extra` installs.

    A `ModuleNotFoundError` (an `ImportError`) carrying the missing module's name, as the import
    that failed would have, with a message that says what to install.
    """
    module = cause.name or "a dependency"
    return ModuleNotFoundError(
        f"{feature} needs {module}, which the `{extra}` extra installs: {install_hint(extra)}",
        name=cause.name,
    )
