"""The replica's modules import each other in one direction only (no cycles), and the
torch-free ones stay so, read from the source's import lines."""

from __future__ import annotations

import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

REPLICA = Path(__file__).resolve().parents[2] / "replica"

# ``from replica.x import ...`` / ``import replica.x``, at any indentation (lazy and
# TYPE_CHECKING imports too: an arrow is an arrow)
IMPORT = re.compile(r"^\s*(?:from|import)\s+replica\.(\w+)", re.MULTILINE)
TORCH = re.compile(r"^\s*(?:from|import)\s+torch\b", re.MULTILINE)


def replica_imports() -> dict[str, set[str]]:
    """module -> the replica modules it imports (top-level modules of the package)."""
    modules = {f.stem for f in REPLICA.glob("*.py") if f.stem != "__init__"}
    return {
        name: set(IMPORT.findall((REPLICA / f"{name}.py").read_text())) & modules - {name}
        for name in modules
    }


def test_replica_imports_have_no_cycle() -> None:
    graph = replica_imports()
    assert {"server", "jobs", "state", "engine", "scheduler", "prefix_cache"} <= set(graph)
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"import cycle: {err.args[1]}") from None
    assert order.index("state") < order.index("jobs") < order.index("server")
    assert order.index("content_index") < order.index("prefix_cache") < order.index("engine")


def test_the_request_path_before_the_engine_imports_no_torch() -> None:
    """Parsing a request, its handle and the cache's bookkeeping need no torch."""
    for name in ("jobs", "state", "handle", "request", "respond", "cache_types", "eviction"):
        assert not TORCH.search((REPLICA / f"{name}.py").read_text()), name
