"""The exception tree drawn in `orchestra._exceptions`'s docstring is the tree of the classes, and the
documentation's account of errors (README and docs/) names only exceptions that exist."""

from __future__ import annotations

import builtins
import re

import orchestra
from orchestra import _exceptions
from tests.helpers import REPO

EXPORTED = {
    name: obj
    for name in orchestra.__all__
    if isinstance(obj := getattr(orchestra, name), type) and issubclass(obj, BaseException)
}


def documentation() -> str:
    """The README and every page of docs/, as one text."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


def drawn_tree() -> dict[str, str | None]:
    """Each class of the docstring's tree, with the class drawn as its parent."""
    doc = _exceptions.__doc__ or ""
    block = doc.split("```")[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.strip().splitlines():
        match = re.match(r"^([\s│├└─]*)(\w+)", line)
        assert match, line
        depth, name = len(match[1]), match[2]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


class TestTheTree:
    def test_every_class_drawn_exists_under_the_parent_drawn(self) -> None:
        for name, parent in drawn_tree().items():
            cls = EXPORTED.get(name)
            assert cls is not None, f"{name} is drawn but not exported"
            if parent is None:
                assert cls.__bases__ == (Exception,)
            else:
                assert EXPORTED[parent] in cls.__bases__, f"{name} is drawn under {parent}"

    def test_every_exported_exception_is_drawn(self) -> None:
        assert set(EXPORTED) == set(drawn_tree())

    def test_the_docs_name_only_exceptions_that_exist(self) -> None:
        docs = documentation()
        named = set(re.findall(r"`(\w+(?:Error|Timeout|Output|Rejected))`", docs))
        assert named, "the docs name no exception"
        from orchestra.agents import claude
        from orchestra.testing import SimulatedAPIError

        others = {"APIResponseValidationError", SimulatedAPIError.__name__}
        others |= {claude.StreamTimeout.__name__, claude.StructuredOutputError.__name__}
        others |= {name for name in named if isinstance(getattr(builtins, name, None), type)}
        assert named <= set(EXPORTED) | others, named - set(EXPORTED) - others

    def test_the_docs_name_every_exception_an_agent_can_end_with(self) -> None:
        readme = documentation()
        for name in (
            "ConfigError",
            "InputError",
            "RetryableError",
            "PermanentError",
            "InvalidOutput",
        ):
            assert f"`{name}`" in readme, name
