"""The public API: every exported name imports, is documented, and the package is typed."""

from __future__ import annotations

import importlib
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest

import orchestra
import orchestra.stores
import orchestra.testing

PUBLIC = sorted(orchestra.__all__)
STORES = sorted(orchestra.stores.__all__)
# The grouped public modules: what observes a run, what its status and its result are made of.
GROUPED = [
    (module.__name__, name)
    for module in (orchestra.events, orchestra.status, orchestra.result)
    for name in module.__all__
]


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

    def test_the_top_level_stays_small(self) -> None:
        # what most programs import; events, status parts and result parts live in their modules
        assert len(orchestra.__all__) <= 50, sorted(orchestra.__all__)

    @pytest.mark.parametrize(("module", "name"), GROUPED)
    def test_every_grouped_name_imports_is_documented_and_names_its_module(
        self, module: str, name: str
    ) -> None:
        obj = getattr(importlib.import_module(module), name)
        assert own_doc(obj), f"{module}.{name} has no docstring"
        # a name also at the top level reports the package, the others their module
        assert obj.__module__ == ("orchestra" if name in orchestra.__all__ else module)
        assert name not in orchestra.__all__ or getattr(orchestra, name) is obj

    def test_the_grouped_modules_are_documented_and_reached_from_the_package(self) -> None:
        for module in (orchestra.events, orchestra.status, orchestra.result):
            assert own_doc(module)
            assert module.__name__.startswith("orchestra.")

    def test_star_import_gives_exactly_all(self) -> None:
        namespace: dict[str, object] = {}
        exec("from orchestra import *", namespace)
        assert set(namespace) - {"__builtins__"} == set(orchestra.__all__)

    @pytest.mark.parametrize(
        "name", ["Orchestrator", "Task", "TaskResult", "RunResult", "agent", "Context"]
    )
    def test_the_core_names_are_exported(self, name: str) -> None:
        assert name in orchestra.__all__

    @pytest.mark.parametrize("name", STORES)
    def test_every_name_of_the_stores_imports_and_is_documented(self, name: str) -> None:
        assert own_doc(getattr(orchestra.stores, name)), f"orchestra.stores.{name} has no docstring"

    def test_the_store_protocol_is_exported(self) -> None:
        assert {"Store", "RunStore"} <= set(orchestra.stores.__all__)

    @pytest.mark.parametrize("name", ["Store", "RunStore"])
    def test_every_member_of_the_store_protocol_is_documented(self, name: str) -> None:
        # The reference for whoever writes a store: mkdocstrings renders these (docs/api.md).
        protocol = getattr(orchestra.stores, name)
        undocumented = [
            member
            for member, value in vars(protocol).items()
            if not member.startswith("_")
            and (callable(value) or isinstance(value, property))
            and not own_doc(value)
        ]
        assert undocumented == []

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


def pickled(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


class TestPublicNamesLookPublic:
    @pytest.mark.parametrize("name", PUBLIC)
    def test_the_module_is_the_package(self, name: str) -> None:
        obj = getattr(orchestra, name)
        assert obj.__module__ == "orchestra", f"orchestra.{name} reports {obj.__module__}"

    @pytest.mark.parametrize("name", STORES)
    def test_a_store_name_reports_the_stores_package(self, name: str) -> None:
        obj = getattr(orchestra.stores, name)
        assert obj.__module__ == "orchestra.stores", (
            f"orchestra.stores.{name} reports {obj.__module__}"
        )

    def test_reprs_name_the_package(self) -> None:
        assert repr(orchestra.Task) == "<class 'orchestra.Task'>"
        assert repr(orchestra.InputError("x")).startswith("InputError(")
        assert orchestra.Orchestrator.__qualname__ == "Orchestrator"

    def test_the_private_modules_still_hold_the_same_objects(self) -> None:
        from orchestra import _task

        assert _task.Task is orchestra.Task  # one class, renamed in place, not a copy


class TestPickling:
    @pytest.mark.parametrize(("module", "name"), GROUPED)
    def test_grouped_classes_pickle_by_their_public_name(self, module: str, name: str) -> None:
        obj = getattr(importlib.import_module(module), name)
        assert pickled(obj) is obj  # pickle finds the class where its __module__ says

    @pytest.mark.parametrize(
        "exc",
        [
            orchestra.OrchestraError("boom"),
            orchestra.ConfigError("concurrency must be at least 1"),
            orchestra.InputError(
                "task 'a' depends on unknown task 'b'", task_id="a", field="depends_on"
            ),
            orchestra.RunError("store lost"),
            orchestra.RetryableError("429", retry_after=2.5),
            orchestra.PermanentError("400"),
            orchestra.AttemptTimeout("slow"),
            orchestra.TaskTimeout("slower"),
            orchestra.VerificationError("cover every clause", output={"clauses": 0}),
            orchestra.Rejected("unsafe"),
            orchestra.InvalidOutput("a coroutine"),
        ],
        ids=lambda exc: type(exc).__name__,
    )
    def test_public_exceptions_round_trip(self, exc: BaseException) -> None:
        back = pickled(exc)
        assert type(back) is type(exc)
        assert back.args == exc.args
        assert vars(back) == vars(exc)  # task_id, field, retry_after, feedback, output

    async def test_a_run_result_and_its_task_results_round_trip(self) -> None:
        @orchestra.agent(kinds=["work"])
        async def half(task: orchestra.Task, ctx: orchestra.Context) -> int:
            if task.payload % 2:
                raise orchestra.PermanentError(f"odd: {task.payload}")
            return int(task.payload) // 2

        tasks = [orchestra.Task("work", n, id=f"t{n}") for n in range(4)]
        async with orchestra.Orchestrator(agents=[half], success_threshold=0.5) as orch:
            streamed = [r async for r in orch.stream(tasks=tasks)]
            result = await orch.run(tasks=[orchestra.Task("work", n, id=f"t{n}") for n in range(4)])
        back = pickled(result)
        assert type(back) is orchestra.RunResult
        assert back == result
        assert [e.task_id for e in back.errors] == ["t1", "t3"]
        for r in streamed:
            copy = pickled(r)
            assert isinstance(copy, orchestra.TaskResult)  # the store's record is one
            assert (copy.task_id, copy.status, copy.output) == (r.task_id, r.status, r.output)
            assert type(copy.task) is orchestra.Task
