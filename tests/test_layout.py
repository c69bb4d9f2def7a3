"""How the package's code is laid out: the Protocols between its layers name public members only,
and its imports read one way, types included."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import types
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import orchestra

PACKAGE = Path(orchestra.__file__).parent


def _protocols() -> list[tuple[str, type]]:
    """Every `Protocol` the package's modules declare (the optional extras' modules left out)."""
    found = []
    for info in pkgutil.walk_packages(orchestra.__path__, "orchestra."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            continue
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == module.__name__
                and Protocol in obj.__mro__[1:]
                and getattr(obj, "_is_protocol", False)
            ):
                found.append((f"{module.__name__}.{name}", obj))
    return sorted(found)


def _members(protocol: type) -> list[str]:
    """The members `protocol` declares: its methods, properties and annotated attributes."""
    kinds = (types.FunctionType, property, classmethod, staticmethod)
    methods = [name for name, value in vars(protocol).items() if isinstance(value, kinds)]
    return methods + list(vars(protocol).get("__annotations__", {}))


class TestProtocolsBetweenLayers:
    def test_a_protocol_names_no_private_member(self) -> None:
        """What a helper asks of its holder (`Owner`, `Host`, `Listener`, ...) is called from
        another object, often another layer: a private name there would make its holder expose
        a private method for others to call."""
        private = [
            f"{where}.{member}"
            for where, protocol in _protocols()
            for member in _members(protocol)
            if member.startswith("_") and not member.startswith("__")
        ]
        assert len(_protocols()) > 10  # (the walk found them)
        assert private == []


# Modules that still name, for their types, a module that imports them at run time: to untie
# (each as `_runconfig.py` did for the run's parts), never to add to.
KNOWN_TYPE_CYCLES = {
    ("orchestra._core._instruments", "orchestra._core._orchestrator"),
    ("orchestra._exceptions", "orchestra._result"),
    ("orchestra._service._replicas", "orchestra._service._state"),
    ("orchestra.stores._postgres._jobs", "orchestra.stores._postgres._store"),
    ("orchestra.stores._postgres._run", "orchestra.stores._postgres._store"),
    ("orchestra.stores._sqlite._keys", "orchestra.stores._sqlite._store"),
    ("orchestra.stores._sqlite._run", "orchestra.stores._sqlite._store"),
    ("orchestra.stores._sqlite._share", "orchestra.stores._sqlite._store"),
    ("orchestra.stores._sqlite._window", "orchestra.stores._sqlite._store"),
}


def _modules() -> dict[str, Path]:
    """The package's modules by dotted name."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, package: str, typing_only: bool) -> list[tuple[str, bool]]:
    """The modules `node` (in a module of `package`) imports from, and whether for types only."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for stmt in child.body:
                found += _imported(ast.Module([stmt], []), package, True)
            for stmt in child.orelse:
                found += _imported(ast.Module([stmt], []), package, typing_only)
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                parts = package.split(".")
                base = parts[: len(parts) - child.level + 1]
                target = ".".join([*base, *([child.module] if child.module else [])])
            else:
                target = child.module or ""
            found += [(target, typing_only)]
            found += [(f"{target}.{alias.name}", typing_only) for alias in child.names]
        elif isinstance(child, ast.stmt):
            found += _imported(child, package, typing_only)
    return found


def _imports() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """The package's imports of its own modules, as (importer, imported): at run time, and under
    `TYPE_CHECKING` (read from the source: what import-linter leaves out)."""
    modules = _modules()
    at_run_time: set[tuple[str, str]] = set()
    for_types: set[tuple[str, str]] = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for imported, typing_only in _imported(tree, package, False):
            if imported in modules and imported != name:
                (for_types if typing_only else at_run_time).add((name, imported))
    return at_run_time, for_types


class TestImportsReadOneWay:
    def test_no_module_names_for_its_types_a_module_that_imports_it(self) -> None:
        """A module that imports another at run time (directly or through others) is not named
        by it even under `TYPE_CHECKING`: the reader would have to know that cycle is for
        types only. What the lower one needs of the upper one is a Protocol below both."""
        at_run_time, for_types = _imports()
        below: dict[str, set[str]] = defaultdict(set)
        for importer, imported in at_run_time:
            below[importer].add(imported)

        def reached(start: str) -> set[str]:
            seen: set[str] = set()
            stack = [start]
            while stack:
                for nxt in below[stack.pop()] - seen:
                    seen.add(nxt)
                    stack.append(nxt)
            return seen

        cycles = {(lower, upper) for lower, upper in for_types if lower in reached(upper)}
        assert ("orchestra._core._dispatch", "orchestra._core._run") not in at_run_time | cycles
        assert sorted(cycles - KNOWN_TYPE_CYCLES) == []
        assert sorted(KNOWN_TYPE_CYCLES - cycles) == []  # untied: take it off the list
