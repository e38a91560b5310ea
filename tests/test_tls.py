"""Certificates rotated on disk (cert-manager, Kubernetes secrets) are reloaded into the
TLS context in use (prefixgate/tls.py ``TLSFiles``), and a running server serves the new
one without a restart (prefixgate/serve.py). Handshakes here are real TLS, between
``ssl`` objects over memory buffers or over loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from prefixgate import tls
from prefixgate.serve import Server
from prefixgate.tls import TLSFiles, client_context
from tests.conftest import wait_until
from tests.support.certs import Certs, issue, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def served_certificate(server: ssl.SSLContext, client: ssl.SSLContext) -> bytes:
    """The DER certificate a handshake between the two contexts shows the client."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    peer = c.getpeercert(binary_form=True)
    assert peer is not None, "no handshake"
    return peer


def der(path: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(path).read_text())


def copy_pair(cert: str, key: str, to: Path) -> tuple[str, str]:
    shutil.copyfile(cert, to / "tls.crt")
    shutil.copyfile(key, to / "tls.key")
    return str(to / "tls.crt"), str(to / "tls.key")


def test_a_rotated_certificate_is_served_and_a_half_rotated_one_is_not(
    certs: Certs, tmp_path: Path
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    cert, key = copy_pair(certs.server_cert, certs.server_key, live)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    files = TLSFiles(context, cert, key, None, "served")
    client = client_context(certs.ca)
    assert served_certificate(context, client) == der(certs.server_cert)
    assert not files.check()  # nothing changed: nothing reloaded

    new_cert, new_key = issue(Path(certs.ca).parent, "renewed")
    shutil.copyfile(new_cert, cert)  # the certificate replaced, its key not yet
    assert not files.check()  # a mismatched pair is not loaded...
    assert served_certificate(context, client) == der(certs.server_cert)  # ...nor served
    shutil.copyfile(new_key, key)
    assert files.check()
    assert served_certificate(context, client) == der(new_cert)


def test_a_client_trusts_a_rotated_ca_and_still_the_old_one(certs: Certs, tmp_path: Path) -> None:
    """The replicas' CA rotates: the gateway's CA file gains the new one."""
    ca_file = tmp_path / "ca.pem"
    shutil.copyfile(certs.ca, ca_file)
    client = client_context(str(ca_file))
    files = TLSFiles(client, None, None, str(ca_file), "upstream")
    old_server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    old_server.load_cert_chain(certs.server_cert, certs.server_key)
    new_cert, new_key = issue(Path(certs.ca).parent, "from-other-ca", ca="other-ca")
    new_server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    new_server.load_cert_chain(new_cert, new_key)
    with pytest.raises(ssl.SSLCertVerificationError):
        served_certificate(new_server, client)  # the new CA is not trusted yet
    ca_file.write_text(Path(certs.other_ca).read_text())  # the file now names the new CA
    assert files.check()
    assert served_certificate(new_server, client) == der(new_cert)
    assert served_certificate(old_server, client) == der(certs.server_cert)


def test_a_file_that_vanishes_keeps_the_context_and_a_link_swap_is_seen(
    certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kubernetes mounts a secret's files through a link it swaps to a new directory."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    copy_pair(certs.server_cert, certs.server_key, first)
    new_cert, _ = copy_pair(*issue(Path(certs.ca).parent, "swapped"), second)
    (tmp_path / "data").symlink_to(first)
    cert, key = str(tmp_path / "data" / "tls.crt"), str(tmp_path / "data" / "tls.key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    files = TLSFiles(context, cert, key, None, "served")
    (tmp_path / "data").unlink()  # between the link's removal and its replacement
    assert not files.check()
    assert "do not load" in caplog.text
    assert served_certificate(context, client_context(certs.ca)) == der(certs.server_cert)
    (tmp_path / "data").symlink_to(second)
    assert files.check()
    assert served_certificate(context, client_context(certs.ca)) == der(new_cert)


@pytest.fixture
def serving(certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The servers' ``Server`` on HTTPS, in a thread, its files checked every 0.1 s, its
    handshakes given 0.5 s."""
    monkeypatch.setattr(tls, "REFRESH_S", 0.1)
    cert, key = copy_pair(certs.server_cert, certs.server_key, tmp_path)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, ssl_certfile=cert, ssl_keyfile=key, lifespan="off"
    )
    server = Server(config, handshake_timeout_s=0.5)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the server started")
    yield server
    server.should_exit = True
    thread.join(10)


def handshake_certificate(port: int, ca: str) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        peer = conn.getpeercert(binary_form=True)
        assert peer is not None
        return peer


def test_a_running_server_serves_its_renewed_certificate(
    serving: Server, certs: Certs, tmp_path: Path
) -> None:
    port = serving.config.port
    assert handshake_certificate(port, certs.ca) == der(certs.server_cert)
    new_cert, new_key = issue(Path(certs.ca).parent, "renewed-while-serving")
    shutil.copyfile(new_key, tmp_path / "tls.key")
    shutil.copyfile(new_cert, tmp_path / "tls.crt")
    wait_until(
        lambda: handshake_certificate(port, certs.ca) == der(new_cert), 10, "the new one served"
    )


def test_a_client_that_never_starts_its_handshake_is_let_go(serving: Server) -> None:
    """It held its connection for the event loop's 60 s, outside the HTTP guard's count
    and timeouts (the guard sees a connection once its handshake is done)."""
    with socket.create_connection(("127.0.0.1", serving.config.port), timeout=10) as raw:
        raw.settimeout(10)  # far below 60 s, far above 0.5 s
        assert raw.recv(1) == b""  # closed by the server; a timeout here fails the test
