"""The gateway's modules import each other in one direction only (no cycles, the app is
imported by nothing but the CLI), read from the source's import lines."""

from __future__ import annotations

import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


# ``from gateway.x import ...`` / ``import gateway.x``, at any indentation (lazy imports too)
IMPORT = re.compile(r"^\s*(?:from|import)\s+gateway\.(\w+)", re.MULTILINE)


def gateway_imports() -> dict[str, set[str]]:
    """module -> the gateway modules it imports."""
    modules = {f.stem for f in GATEWAY.glob("*.py") if f.stem != "__init__"}
    return {
        name: set(IMPORT.findall((GATEWAY / f"{name}.py").read_text())) & modules - {name}
        for name in modules
    }


def test_gateway_imports_have_no_cycle() -> None:
    graph = gateway_imports()
    assert {"app", "state", "handler", "proxy"} <= set(graph)
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"import cycle: {err.args[1]}") from None
    assert order.index("state") < order.index("handler") < order.index("app")


def test_only_the_cli_imports_the_app() -> None:
    importers = {name for name, deps in gateway_imports().items() if "app" in deps}
    assert importers == {"cli"}
