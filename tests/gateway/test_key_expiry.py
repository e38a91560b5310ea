"""A key's ``expires`` (gateway/auth.py): refused from that moment, with no edit of the
keys file and no restart. Without it a trial key stayed valid until someone removed it."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, date, datetime
from pathlib import Path

import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from gateway.auth import Authenticator, parse_api_keys
from gateway.keys_file import REFRESH_S
from prefixgate.wire import OpenAIError
from tests.gateway.conftest import start_gateway, start_stub

pytestmark = pytest.mark.timeout(120)

MODEL = "expiry-model"


def test_expiry_forms_and_their_zone() -> None:
    keys = yaml.safe_load(
        """
        a: {tenant: t, expires: 2027-01-31T12:00:00Z}
        b: {tenant: t, expires: "2027-01-31T12:00:00+02:00"}
        c: {tenant: t, expires: "2027-01-31T12:00:00"}
        d: {tenant: t, expires: 2027-01-31}
        e: {tenant: t}
        """
    )
    parsed = parse_api_keys(keys)
    noon = datetime(2027, 1, 31, 12, tzinfo=UTC).timestamp()
    assert parsed["a"].expires == parsed["c"].expires == noon  # no zone: UTC
    assert parsed["b"].expires == noon - 2 * 3600
    assert (
        parsed["d"].expires
        == datetime.combine(date(2027, 1, 31), datetime.min.time(), UTC).timestamp()
    )
    assert parsed["e"].expires is None
    for bad in ("next week", 1706745600, True, ["2027-01-31"]):
        with pytest.raises(ValueError, match="expires"):
            parse_api_keys({"k": {"tenant": "t", "expires": bad}})


def test_an_expired_key_is_refused_and_a_live_one_served() -> None:
    past = datetime.fromtimestamp(time.time() - 1, UTC).isoformat()
    future = datetime.fromtimestamp(time.time() + 3600, UTC).isoformat()
    auth = Authenticator(
        parse_api_keys(
            {"old": {"tenant": "t", "expires": past}, "new": {"tenant": "t", "expires": future}}
        )
    )
    assert auth.authenticate("Bearer new").name == "t"
    with pytest.raises(OpenAIError, match="expired") as refused:
        auth.authenticate("Bearer old")
    assert refused.value.status == 401


def test_a_key_ends_at_its_time_through_a_running_gateway(tmp_path: Path) -> None:
    """The expiry is given once the gateway runs (the keys file is read again): a slow
    start cannot make the key expire before it is first served."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-trial": {"tenant": "t"}}))
    stub = start_stub(tmp_path, "stub", "--model", MODEL)
    gateway = start_gateway(tmp_path, "keyed", [stub.url], "--api-keys", str(keys))
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-trial", max_retries=0)
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    try:
        assert client.chat.completions.create(model=MODEL, messages=chat).model == MODEL
        soon = time.time() + 2 * REFRESH_S + 2
        scratch = tmp_path / "keys.new"
        expires = datetime.fromtimestamp(soon, UTC).isoformat()
        scratch.write_text(json.dumps({"sk-trial": {"tenant": "t", "expires": expires}}))
        os.replace(scratch, keys)
        deadline = soon + 3 * REFRESH_S + 5
        while True:
            try:
                client.chat.completions.create(model=MODEL, messages=chat)
            except openai.AuthenticationError as exc:
                assert "expired" in str(exc)
                break
            assert time.time() < deadline, "the key was still served after its time"
        assert time.time() >= soon  # not before it
    finally:
        gateway.stop()
        stub.stop()
