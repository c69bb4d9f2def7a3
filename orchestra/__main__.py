"""``python -m orchestra`` and the ``orchestra`` command.

The command's script is installed with the package whatever its extras; without the `cli` extra
(typer, rich) it says which one to install instead of failing on an import.
"""

from __future__ import annotations

import sys

from ._extras import missing_extra

__all__ = ("main",)

_CLI_PACKAGES = frozenset({"typer", "rich", "click"})


def main() -> None:
    """Run the `orchestra` command (`orchestra._cli._app`)."""
    try:
        from ._cli._app import main as cli
    except ModuleNotFoundError as exc:
        if exc.name not in _CLI_PACKAGES:
            raise
        print(f"orchestra: {missing_extra('the command', 'cli', exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    cli()


if __name__ == "__main__":
    main()
