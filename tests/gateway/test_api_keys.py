"""API key files and the authenticator (gateway/auth.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.auth import Authenticator, derived_salt, load_api_keys, parse_api_keys
from prefixgate.wire import OpenAIError


def test_api_keys_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "k.json").write_text(json.dumps({"sk-1": {"tenant": "a"}}))
    (tmp_path / "k.yaml").write_text(
        "sk-2: {tenant: b, cache_salt: s2}\nsk-3: {tenant: c, shared_namespace: true}\n"
    )
    assert load_api_keys(tmp_path / "k.json")["sk-1"].salt == derived_salt("a")
    yaml_keys = load_api_keys(tmp_path / "k.yaml")
    assert yaml_keys["sk-2"].salt == "s2" and yaml_keys["sk-3"].salt == ""
    with pytest.raises(ValueError):
        parse_api_keys({"sk-4": {"no_tenant": 1}})
    keys = parse_api_keys({"sk-5": {"tenant": "ops", "admin": True}, "sk-6": "plain"})
    assert keys["sk-5"].admin and not keys["sk-6"].admin
    with pytest.raises(ValueError, match="admin"):
        parse_api_keys({"sk-7": {"tenant": "x", "admin": "yes"}})


def test_authenticator() -> None:
    auth = Authenticator(parse_api_keys({"sk-1": {"tenant": "a"}}))
    assert auth.authenticate("Bearer sk-1").name == "a"
    for header in (None, "sk-1", "Bearer sk-2"):
        with pytest.raises(OpenAIError) as err:
            auth.authenticate(header)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    tenant = auth.authenticate("Bearer sk-1")
    assert auth.forwarded_salt(tenant, "client-choice") == derived_salt("a")
    open_auth = Authenticator(None)
    assert open_auth.forwarded_salt(open_auth.authenticate(None), "mine") == "mine"
