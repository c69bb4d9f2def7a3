"""The public API: every exported name imports, is documented, and the package is typed."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import orchestra
import orchestra.testing

PUBLIC = sorted(orchestra.__all__)


def own_doc(obj: object) -> str:
    """The object's own docstring (a dataclass's generated signature does not count)."""
    doc = inspect.getdoc(obj) or ""
    name = getattr(obj, "__name__", "")
    if name and doc.startswith(f"{name}("):
        return ""
    return doc.strip()


class TestExports:
    def test_all_has_no_duplicates(self) -> None:
        assert len(orchestra.__all__) == len(set(orchestra.__all__))

    @pytest.mark.parametrize("name", PUBLIC)
    def test_every_name_imports_and_is_documented(self, name: str) -> None:
        module = importlib.import_module("orchestra")
        obj = getattr(module, name)
        assert own_doc(obj), f"orchestra.{name} has no docstring"

    def test_star_import_gives_exactly_all(self) -> None:
        namespace: dict[str, object] = {}
        exec("from orchestra import *", namespace)
        assert set(namespace) - {"__builtins__"} == set(orchestra.__all__)

    @pytest.mark.parametrize(
        "name", ["Orchestrator", "Task", "TaskResult", "RunResult", "agent", "Context"]
    )
    def test_the_core_names_are_exported(self, name: str) -> None:
        assert name in orchestra.__all__

    def test_public_methods_of_the_orchestrator_are_documented(self) -> None:
        undocumented = [
            name
            for name, member in vars(orchestra.Orchestrator).items()
            if not name.startswith("_") and callable(member) and not own_doc(member)
        ]
        assert undocumented == []

    @pytest.mark.parametrize("name", sorted(orchestra.testing.__all__))
    def test_the_fault_kit_exports(self, name: str) -> None:
        assert hasattr(orchestra.testing, name)

    def test_the_package_and_its_modules_are_documented(self) -> None:
        assert own_doc(orchestra)
        assert own_doc(orchestra.testing)

    def test_the_package_is_typed(self) -> None:
        assert (Path(orchestra.__file__).parent / "py.typed").is_file()

    def test_a_version(self) -> None:
        assert isinstance(orchestra.__version__, str)
        assert orchestra.__version__
