"""``POST /reset_prefix_cache`` on the gateway in front of other engines (gateway/
cache_reset.py): vLLM serves the reset only in its development mode and answers
``{"success": false}`` while requests hold blocks; SGLang calls it ``/flush_cache``.
Before, a busy vLLM counted as reset (the router forgot blocks the engine kept), SGLang
was a bare 404, and so was a vLLM outside development mode, with nothing saying why."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)


def test_each_engines_reset_is_used_or_named(tmp_path: Path) -> None:
    styles = ("vllm", "vllm-busy", "sglang", "none")
    stubs = {s: start_stub(tmp_path, s, "--model", "m", "--reset", s) for s in styles}
    gw = start_gateway(tmp_path, "gw", [s.url for s in stubs.values()])
    try:
        answer = httpx.post(gw.url + "/reset_prefix_cache", timeout=60)
        assert answer.status_code == 502  # not every replica was reset
        results = answer.json()["replicas"]
        by_style = {s: results[stub.url.split("//")[1]] for s, stub in stubs.items()}
        assert "error" not in by_style["vllm"] and "error" not in by_style["sglang"]
        assert "running requests hold blocks" in by_style["vllm-busy"]["error"]
        assert "VLLM_SERVER_DEV_MODE=1" in by_style["none"]["error"]
    finally:
        for server in (gw, *stubs.values()):
            server.stop()
