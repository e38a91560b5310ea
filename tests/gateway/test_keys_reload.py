"""The ``--api-keys`` file read again when it changes (gateway/keys_file.py): a revoked key
is refused and a new one served within seconds, without a restart. Before, revoking a
leaked key took a restart of every gateway."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.auth import Authenticator
from gateway.keys_file import REFRESH_S, KeysFile
from tests.gateway.conftest import Server, start_gateway, start_stub

pytestmark = pytest.mark.timeout(180)

MODEL = "keys-model"


def _write(path: Path, keys: object) -> None:
    """Replaced whole, as a tool or Kubernetes replaces a file (a rename)."""
    scratch = path.with_suffix(".new")
    scratch.write_text(keys if isinstance(keys, str) else json.dumps(keys))
    os.replace(scratch, path)


def test_a_change_is_applied_once_settled_and_only_if_it_parses(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    _write(path, {"sk-a": {"tenant": "a"}})
    watched = KeysFile(path)
    assert watched.check() is None  # unchanged
    _write(path, {"sk-b": {"tenant": "b", "rpm_limit": 5}})
    assert watched.check() is None  # changed since the last check: not settled yet
    auth = watched.check()
    assert isinstance(auth, Authenticator)
    assert auth.authenticate("Bearer sk-b").name == "b"
    assert auth.rates.keys() == {"b"}
    assert watched.check() is None  # applied: nothing new
    _write(path, '{"sk-c": {"tenant": ')  # cut short
    assert watched.check() is None
    assert watched.check() is None  # settled, but does not parse: the keys in use stay
    assert watched.check() is None  # and it is not tried again until it changes
    _write(path, {"sk-c": {"tenant": "c", "rpm_limit": 0}})  # parses; refused by the rules
    assert watched.check() is None and watched.check() is None
    path.unlink()  # gone: the keys in use stay
    assert watched.check() is None and watched.check() is None


def _status(gateway: Server, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}"}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    return r.status_code


def _until(gateway: Server, expected: dict[str, int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (seen := {key: _status(gateway, key) for key in expected}) != expected:
        assert time.monotonic() < deadline, f"still {seen}, expected {expected}"


def test_a_running_gateway_takes_new_keys_from_the_file(tmp_path: Path) -> None:
    """Kubernetes mounts a Secret as a link into a directory it swaps: the file the path
    names changes while the path does not."""
    data = tmp_path / "v1"
    data.mkdir()
    _write(data / "keys.json", {"sk-old": {"tenant": "team"}})
    (tmp_path / "..data").symlink_to(data)
    keys = tmp_path / "keys.json"
    keys.symlink_to(tmp_path / "..data" / "keys.json")
    stub = start_stub(tmp_path, "stub", "--model", MODEL)
    gateway = start_gateway(tmp_path, "keyed", [stub.url], "--api-keys", str(keys))
    try:
        assert _status(gateway, "sk-old") == 200
        assert _status(gateway, "sk-new") == 401
        fresh = tmp_path / "v2"
        fresh.mkdir()
        _write(fresh / "keys.json", {"sk-new": {"tenant": "team", "rpm_limit": 2}})
        (tmp_path / "..data.tmp").symlink_to(fresh)
        os.replace(tmp_path / "..data.tmp", tmp_path / "..data")  # as the kubelet swaps it
        _until(gateway, {"sk-old": 401}, within_s=3 * REFRESH_S + 5)
        # The new key is served, and its limit holds: two a minute.
        assert [_status(gateway, "sk-new") for _ in range(3)] == [200, 200, 429]
        # A file that does not parse keeps the keys in use.
        _write(fresh / "keys.json", "sk-new: [unclosed")
        deadline = time.monotonic() + 3 * REFRESH_S + 5
        while "does not load" not in gateway.log_text():
            assert time.monotonic() < deadline, "the broken file was never read"
            time.sleep(0.1)  # polling the gateway's log
        assert _status(gateway, "sk-new") == 429  # still the tenant's key, still limited
        assert _status(gateway, "sk-old") == 401
    finally:
        gateway.stop()
        stub.stop()


def test_a_cap_given_while_requests_run_counts_only_what_it_admitted(tmp_path: Path) -> None:
    """Requests admitted before the tenant had a cap were never counted: when they end
    they must not give back a slot a later request holds."""
    keys = tmp_path / "keys.json"
    _write(keys, {"sk-t": {"tenant": "t"}})
    stub = start_stub(tmp_path, "slow", "--model", MODEL, "--delay-ms", "8000")
    gateway = start_gateway(tmp_path, "keyed", [stub.url], "--api-keys", str(keys))
    try:
        with ThreadPoolExecutor(4) as pool:
            early = [pool.submit(_status, gateway, "sk-t") for _ in range(2)]
            _write(keys, {"sk-t": {"tenant": "t", "max_parallel_requests": 1}})
            deadline = time.monotonic() + 3 * REFRESH_S + 5
            while "API keys reloaded" not in gateway.log_text():
                assert time.monotonic() < deadline, "the new keys were never read"
                time.sleep(0.1)  # polling the gateway's log
            assert not any(f.done() for f in early), "the stub's delay is too short here"
            held = pool.submit(_status, gateway, "sk-t")  # the cap's one slot
            assert [f.result() for f in early] == [200, 200]
            assert _status(gateway, "sk-t") == 429  # the slot is still held
            assert held.result() == 200
    finally:
        gateway.stop()
        stub.stop()
