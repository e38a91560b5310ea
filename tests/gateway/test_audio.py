"""OpenAI's audio API through the gateway (gateway/audio.py): the official client's
transcriptions and translations, form uploads, reach a replica serving their model with
the body and its content type unchanged; streams pass; keyed mode takes the forms on
these paths only. The gateway answered 404 (and, keyed, 415).

A stub engine stands in for vLLM serving a speech model: no such model runs here."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway.conftest import (
    Server,
    StubCluster,
    start_gateway,
    stub_cluster,
    write_api_keys,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "whisper-small"
AUDIO = bytes(range(256)) * 64  # 16 KiB of "audio": the gateway never reads it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubCluster]:
    with stub_cluster(tmp_path_factory.mktemp("audio"), MODEL) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, cluster: StubCluster) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("audio-keyed")
    keys = str(write_api_keys(root / "keys.json"))
    urls = [s.url for s in cluster.stubs]
    gateway = start_gateway(root, "keyed", urls, "--model", MODEL, "--api-keys", keys)
    yield gateway
    gateway.stop()


def test_a_transcription_reaches_the_engine_as_sent(cluster: StubCluster) -> None:
    client = openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key="x", max_retries=0)
    raw = client.audio.transcriptions.with_raw_response.create(
        model=MODEL, file=("clip.wav", AUDIO), language="en"
    )
    assert raw.parse().text == "stub transcript"
    assert raw.headers["x-prefixgate-replica"]
    # The engine gets the form byte for byte, with its boundary.
    form = httpx.Request(
        "POST", "http://x", files={"file": ("clip.wav", AUDIO)}, data={"model": MODEL}
    )
    body = form.read()
    answer = httpx.post(
        cluster.gateway.url + "/v1/audio/transcriptions",
        content=body,
        headers={"content-type": form.headers["content-type"]},
    )
    assert answer.status_code == 200
    seen = [r for r in cluster.received("/v1/audio/transcriptions")]
    digest = hashlib.sha256(body).hexdigest()
    [forwarded] = [r for r in seen if r["sha256"] == digest]
    headers = forwarded["headers"]
    assert isinstance(headers, dict)
    assert headers["content-type"] == form.headers["content-type"]


def test_a_translation_streams(cluster: StubCluster) -> None:
    files = {"file": ("clip.wav", AUDIO)}
    data = {"model": MODEL, "stream": "true"}
    with httpx.stream(
        "POST", cluster.gateway.url + "/v1/audio/translations", files=files, data=data
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")


def test_the_forms_model_picks_the_replicas(cluster: StubCluster) -> None:
    files = {"file": ("clip.wav", AUDIO)}
    url = cluster.gateway.url + "/v1/audio/transcriptions"
    unknown = httpx.post(url, files=files, data={"model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    named_none = httpx.post(url, files=files)  # the one model the replicas serve
    assert named_none.status_code == 200
    not_a_form = httpx.post(url, json={"model": MODEL})
    assert not_a_form.status_code == 400 and "multipart/form-data" in not_a_form.text


def test_keyed_mode_takes_forms_on_the_audio_paths_only(
    cluster: StubCluster, keyed: Server
) -> None:
    files = {"file": ("clip.wav", AUDIO)}
    key = {"authorization": "Bearer sk-alpha"}
    answer = httpx.post(
        keyed.url + "/v1/audio/transcriptions", files=files, data={"model": MODEL}, headers=key
    )
    assert answer.status_code == 200, answer.text
    no_key = httpx.post(keyed.url + "/v1/audio/transcriptions", files=files, data={"model": MODEL})
    assert no_key.status_code == 401
    chat_form = httpx.post(keyed.url + "/v1/chat/completions", files=files, headers=key)
    assert chat_form.status_code == 415


def test_form_fields_reads_text_fields_only() -> None:
    from gateway.audio import form_fields

    def form(*parts: tuple[bytes, bytes]) -> bytes:
        body = b""
        for disposition, value in parts:
            body += b"--XyZ\r\nContent-Disposition: form-data; " + disposition
            body += b"\r\n\r\n" + value + b"\r\n"
        return body + b"--XyZ--\r\n"

    model = (b'name="model"', MODEL.encode())
    stream = (b'name="stream"', b"true")
    audio = (b'name="file"; filename="a.wav"\r\nContent-Type: audio/wav', AUDIO)
    quoted = 'multipart/form-data; boundary="XyZ"'
    assert form_fields(form(model, audio, stream), quoted) == {"model": MODEL, "stream": "true"}
    # A file part named "model" is not the model; a field too long to be one is skipped.
    as_file = (b'name="model"; filename="m.txt"', b"other")
    assert form_fields(form(as_file), quoted) == {}
    assert form_fields(form((b'name="model"', b"m" * 5000)), quoted) == {}
    assert form_fields(b"--XyZ--\r\n", quoted) == {}
    assert form_fields(b"garbage", quoted) == {}
