"""The gateway's modules import each other in one direction only (no cycles, the app is
imported by nothing but the CLI), read from the source with ``ast``."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def gateway_imports() -> dict[str, set[str]]:
    """module -> the gateway modules it imports (at any level, lazy imports included)."""
    modules = {f.stem for f in GATEWAY.glob("*.py") if f.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((GATEWAY / f"{name}.py").read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t.split(".")[1] for t in targets if t.startswith("gateway.")}
        graph[name] = (deps & modules) - {name}
    return graph


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
