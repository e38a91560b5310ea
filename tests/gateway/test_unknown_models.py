"""A model name from a client while some replica's model is unknown (a static replica
never reached yet): the gateway lets the request through to it, and must not take the
name for a tokenizer folder to read on its own disk (gateway/routing.py, ``served``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from prefixgate.procs import free_port
from tests.gateway.conftest import start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)


def test_a_model_name_is_not_a_folder_the_gateway_reads(tmp_path: Path) -> None:
    stub = start_stub(tmp_path, "stub", "--model", "stub-model")
    never_up = f"http://127.0.0.1:{free_port()}"  # its model stays unknown
    gateway = start_gateway(tmp_path, "gateway", [stub.url, never_up])
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "tokenizer.json").write_text("{ not a tokenizer")
    try:
        for _ in range(2):
            r = httpx.post(
                gateway.url + "/v1/completions",
                json={"model": str(planted), "prompt": "hello " * 40, "max_tokens": 1},
                timeout=30,
            )
            assert r.status_code in (200, 502), r.text  # the stub answers any model
        served = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "stub-model", "prompt": "hello", "max_tokens": 1},
            timeout=30,
        )
        assert served.status_code == 200, served.text
    finally:
        gateway.stop()
        stub.stop()
    # Before: "no tokenizer for model '<planted>' (...)": the folder was read.
    assert f"no tokenizer for model {str(planted)!r}" not in gateway.log_text()
