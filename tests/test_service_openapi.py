"""The published OpenAPI document is accurate: schemathesis (the dev group) generates requests
from it against the live service (a real uvicorn, a real SQLite file) and checks that no answer
is a 500, none has a status the document does not declare for its route, and every answer fits
its declared schema and content type."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import anyio
import pytest

from orchestra.stores import SQLiteStore
from tests.service_kit import server, serving

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# The live event stream (it ends only with its run) is left to tests/test_service_events.py; the
# stop route waits for the run it stops, which generated ones never have.
_EXCLUDED = "^/api/runs/\\{run_id\\}/events$"


async def test_no_generated_request_gets_a_500_or_an_undocumented_answer(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "openapi.db")
    try:
        async with serving(store) as api:
            api.gate.set()
            await api.submit({"tasks": [{"kind": "echo", "id": "a"}], "run_id": "r1"})
            async with server(api.app) as url:
                done = await anyio.run_process(
                    [
                        sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
                        "--header", f"Authorization: Bearer {api.tokens['admin']}",
                        "--checks", "not_a_server_error,status_code_conformance,"
                        "content_type_conformance,response_schema_conformance",
                        "--exclude-path-regex", _EXCLUDED,
                        "--max-examples", "15", "--seed", "1", "--workers", "1",
                        "--phases", "examples,fuzzing",
                        "--request-timeout", "20",
                    ],
                    check=False,
                    cwd=tmp_path,  # (schemathesis keeps a cache in its working directory)
                    env={**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"},
                )  # fmt: skip
    finally:
        store.close()
    report = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    assert done.returncode == 0, report[-6000:]
