"""The dependency rule around the bridge: zmq and msgpack stay in bridge/; the bridge
itself stays torch-free and imports no gateway or replica code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(?:from|import)\s+(\w+)", re.MULTILINE)


def imported_packages(folder: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        found |= set(IMPORT.findall(path.read_text()))
    return found


def test_only_the_bridge_imports_zmq_and_msgpack() -> None:
    for folder in ("gateway", "router", "replica", "prefixgate", "loadtest"):
        assert not imported_packages(folder) & {"zmq", "msgpack"}, folder
    assert {"zmq", "msgpack"} <= imported_packages("bridge")


def test_bridge_imports_only_router_and_prefixgate_of_ours() -> None:
    ours = imported_packages("bridge") & {"gateway", "replica", "loadtest", "router", "prefixgate"}
    assert ours <= {"router", "prefixgate", "bridge"}


def test_the_bridge_process_loads_no_torch() -> None:
    code = (
        "import sys, bridge.cli, bridge.service, bridge.tokenizer_check; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.split() == ["False", "False"]
