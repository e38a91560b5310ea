"""HTTPS on both sides of the gateway, with vLLM's TLS flags.

A vLLM started with ``--ssl-certfile`` (usually from a private CA, with ``--ssl-cert-reqs
2`` where clients must show a certificate) was unreachable through the gateway: its
health probes trusted only certifi's CAs, and nothing could name another, so the engine
was never healthy and every request was a 503 with no word in the log. The gateway could
not serve HTTPS either, so a client of such an engine could not keep its URL scheme.

Here a built-in replica serves HTTPS and requires a client certificate, registered
through Redis; gateways serve HTTPS in front of it; the official client talks to them."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli import main as gateway_main
from prefixgate.procs import free_port, stop_process
from prefixgate.tls import client_context
from replica.cli import main as replica_main
from tests.conftest import RedisServer, wait_until
from tests.support.certs import Certs, make_certs

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-random"
LONG = "Every request repeats this system prompt so the second finds it cached. " * 12


class TlsServer:
    """A server process reached over HTTPS: ready when ``/health`` answers through a
    client that trusts ``ca`` and shows ``cert`` (polled, never slept on)."""

    def __init__(self, args: list[str], workdir: Path, name: str, port: int, certs: Certs):
        self.url = f"https://127.0.0.1:{port}"
        self.log = workdir / f"{name}.log"
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefixgate", *args, "--port", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        tls = client_context(certs.ca, certs.client_cert, certs.client_key)
        with httpx.Client(verify=tls, timeout=2.0) as client:

            def up() -> bool:
                assert self.proc.poll() is None, self.log.read_text()[-3000:]
                try:
                    return client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(up, 120, f"{name} healthy over HTTPS")

    def stop(self) -> None:
        stop_process(self.proc, grace_s=5)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class Cluster:
    def __init__(self, root: Path, redis_url: str) -> None:
        self.certs = c = make_certs(root / "certs")
        serving = ["--ssl-certfile", c.server_cert, "--ssl-keyfile", c.server_key]
        self.replica = TlsServer(
            ["replica", "--model", MODEL, "--redis-url", redis_url, "--heartbeat-s", "0.2",
             *serving, "--ssl-ca-certs", c.ca, "--ssl-cert-reqs", "2"],
            root, "replica", free_port(), c,
        )  # fmt: skip
        upstream = ["--upstream-ca-certs", c.ca]
        client_cert = ["--upstream-certfile", c.client_cert, "--upstream-keyfile", c.client_key]
        self.gateway = TlsServer(
            ["gateway", "--redis-url", redis_url, "--probe-interval-s", "0.5",
             *upstream, *client_cert, *serving],
            root, "gateway", free_port(), c,
        )  # fmt: skip
        # Trusts another CA: the replica's certificate does not verify.
        self.distrusting = TlsServer(
            ["gateway", "--replica", self.replica.url, "--probe-interval-s", "0.5",
             "--upstream-ca-certs", c.other_ca, *client_cert, *serving],
            root, "distrusting", free_port(), c,
        )  # fmt: skip
        # Trusts the CA but shows no certificate: the replica ends the handshake.
        self.anonymous = TlsServer(
            ["gateway", "--replica", self.replica.url, "--probe-interval-s", "0.5",
             *upstream, *serving],
            root, "anonymous", free_port(), c,
        )  # fmt: skip

    def stop(self) -> None:
        for server in (self.anonymous, self.distrusting, self.gateway, self.replica):
            server.stop()

    def client(self, server: TlsServer) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=client_context(self.certs.ca), timeout=60.0)
        return openai.OpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    c = Cluster(tmp_path_factory.mktemp("tls"), redis.url)
    yield c
    c.stop()
    redis.stop()


def _ask(client: openai.OpenAI, question: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": LONG}, {"role": "user", "content": question}],
        max_tokens=4,
    )


def test_a_replica_serving_https_is_found_through_redis_and_its_cache_is_used(
    cluster: Cluster,
) -> None:
    """The gateway knows the replica only from its registry record (it serves HTTPS
    alone), so an answer means the record's URL was https and the gateway's certificate
    was taken."""
    client = cluster.client(cluster.gateway)
    wait_until(lambda: [m.id for m in client.models.list()] == [MODEL], 30, "the model listed")
    first = _ask(client, "What is it?")
    assert first.choices[0].message.content
    second = _ask(client, "And now?")
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 100
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert [chunk for chunk in stream if chunk.choices and chunk.choices[0].finish_reason]


def test_the_replica_wants_a_client_certificate(cluster: Cluster) -> None:
    with pytest.raises(httpx.HTTPError):  # the handshake, or the first read, fails
        httpx.get(cluster.replica.url + "/health", verify=client_context(cluster.certs.ca))
    shown = client_context(cluster.certs.ca, cluster.certs.client_cert, cluster.certs.client_key)
    assert httpx.get(cluster.replica.url + "/health", verify=shown).status_code == 200


@pytest.mark.parametrize(
    ("gateway", "said"),
    [
        ("distrusting", "its certificate does not verify"),
        ("anonymous", "as a server that wants a client certificate does"),
    ],
)
def test_a_gateway_that_cannot_reach_it_says_why_once(
    cluster: Cluster, gateway: str, said: str
) -> None:
    server: TlsServer = getattr(cluster, gateway)
    client = cluster.client(server)
    with pytest.raises(openai.APIStatusError) as caught:
        _ask(client, "hello")
    assert caught.value.status_code == 503
    wait_until(lambda: said in server.log_text(), 20, "the reason logged")
    time.sleep(1.6)  # an observation window of three more probes (0.5 s apart), not a wait
    log = server.log_text()
    assert log.count("is never healthy while") == 1
    assert ("--upstream-ca-certs" if gateway == "distrusting" else "--upstream-certfile") in log


def test_plain_http_to_an_https_gateway_is_refused_not_served(cluster: Cluster) -> None:
    plain = cluster.gateway.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=5)
    assert cluster.gateway.proc.poll() is None  # and the gateway serves on
    assert httpx.get(
        cluster.gateway.url + "/health", verify=client_context(cluster.certs.ca)
    ).is_success


def test_files_that_do_not_load_stop_the_servers_with_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    missing = str(tmp_path / "missing.pem")
    cases = [
        (gateway_main, ["--upstream-ca-certs", missing], "--upstream-ca-certs: no such file"),
        (gateway_main, ["--upstream-ca-certs", str(junk)], "--upstream-ca-certs"),
        (gateway_main, ["--upstream-keyfile", str(junk)], "needs --upstream-certfile"),
        (gateway_main, ["--ssl-certfile", str(junk)], "--ssl-certfile"),
        (gateway_main, ["--ssl-keyfile", str(junk)], "need --ssl-certfile"),
        (replica_main, ["--model", "sim", "--ssl-certfile", missing], "--ssl-certfile"),
    ]
    for main, flags, said in cases:
        assert main([*flags, "--port", "1"]) == 2, flags
        out = capsys.readouterr()
        assert said in out.out + out.err, (flags, out)


def test_the_client_context_verifies_names_and_certificates() -> None:
    context = client_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
