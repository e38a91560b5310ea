"""Certificates for the TLS tests: a private CA, and a server and a client certificate it
signed, made with the ``openssl`` command (a test that needs them skips without it)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True, slots=True)
class Certs:
    ca: str  # the CA's certificate
    server_cert: str  # for 127.0.0.1 and localhost
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed none of them


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _self_signed(cwd: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN=prefixgate {name}",
        cwd=cwd,
    )  # fmt: skip


def _signed(cwd: Path, name: str, ca: str = "ca") -> None:
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=cwd,
    )  # fmt: skip
    (cwd / f"{name}.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
        cwd=cwd,
    )  # fmt: skip


def issue(directory: Path, name: str, ca: str = "ca") -> tuple[str, str]:
    """Another certificate for 127.0.0.1 (``name``.pem, ``name``.key) signed by ``ca``
    (``ca`` or ``other-ca`` of ``make_certs``; ``directory`` is theirs), with a key of its
    own."""
    _signed(directory, name, ca)
    return f"{directory}/{name}.pem", f"{directory}/{name}.key"


def make_certs(directory: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    _self_signed(directory, "ca")
    _self_signed(directory, "other-ca")
    _signed(directory, "server")
    _signed(directory, "client")
    d = str(directory)
    return Certs(
        f"{d}/ca.pem",
        f"{d}/server.pem",
        f"{d}/server.key",
        f"{d}/client.pem",
        f"{d}/client.key",
        f"{d}/other-ca.pem",
    )
