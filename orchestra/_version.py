"""The package version (one place: pyproject reads it, `orchestra.__version__` and the command show it)."""

__version__ = "0.1.0"
