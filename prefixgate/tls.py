"""TLS for the servers and for their connections to engines. Torch-free.

Serving: ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and ``--ssl-cert-reqs``
are vLLM's flags (and uvicorn's options) of the same names, so an engine's TLS settings
carry over to the gateway that replaces its URL, and to the built-in replica.

Calling engines: an engine started with vLLM's TLS flags has a certificate the gateway
(and a bridge) must verify, usually from a private CA, and may require a client
certificate (``--ssl-cert-reqs 2``). One ``ssl.SSLContext`` serves every connection to
the engines: the proxied requests, the health probes and model discovery, the bridge's
calls. Without a CA file it trusts the system's store, and ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` as OpenSSL reads them; with one, that CA alone. The files are read at
start-up, so a missing or unreadable one stops the command with its name.

Rotation: cert-manager and Kubernetes secrets replace certificates before they expire,
and a process that keeps the old one fails every handshake once it has. Every process
here reloads its TLS files into the context in use when they change (``TLSFiles``: a
stat of each every ``REFRESH_S``; vLLM does it with ``--enable-ssl-refresh``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import ssl
import tempfile
from typing import Any

import httpx

from prefixgate.envflags import add_env_flag, env_var

log = logging.getLogger("prefixgate.tls")

REFRESH_S = 10.0  # how often TLS files are checked for a replacement

# vLLM's --ssl-cert-reqs values: the ssl module's CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED.
CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


def add_server_tls_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's serving TLS flags."""
    add_env_flag(parser, "ssl-keyfile", metavar="FILE", help="serve HTTPS: the private key")
    add_env_flag(parser, "ssl-certfile", metavar="FILE", help="serve HTTPS: the certificate")
    add_env_flag(
        parser,
        "ssl-ca-certs",
        metavar="FILE",
        help="the CA certificates that client certificates are verified against",
    )
    add_env_flag(
        parser,
        "ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=CERT_REQS,
        help="client certificates: 0 not asked for, 1 verified when sent, 2 required",
    )


def server_tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's keyword arguments for the serving flags (none without a certificate).
    Raises ValueError naming the flag whose file does not load."""
    key, cert, ca, reqs = args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs
    if cert is None:
        if key is not None or ca is not None or reqs != ssl.CERT_NONE:
            raise ValueError(
                "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"
            )
        return {}
    if reqs != ssl.CERT_NONE and ca is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to verify clients against")
    # Loaded here, as uvicorn will, so that a bad file is one line naming it, not a traceback.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, cert, key, "--ssl-certfile", "--ssl-keyfile")
    if ca is not None:
        _load_cas(context, ca, "--ssl-ca-certs")
    return {
        "ssl_certfile": cert,
        "ssl_keyfile": key,
        "ssl_ca_certs": ca,
        "ssl_cert_reqs": reqs,
    }


def served_scheme(args: argparse.Namespace) -> str:
    """The scheme clients call this server by."""
    return "https" if args.ssl_certfile is not None else "http"


def add_client_tls_flags(parser: argparse.ArgumentParser, prefix: str, them: str) -> None:
    """``--{prefix}-ca-certs``, ``--{prefix}-certfile``, ``--{prefix}-keyfile``: how to
    verify the HTTPS servers this process calls (``them``), and the certificate it shows
    those that ask for one."""
    add_env_flag(
        parser,
        f"{prefix}-ca-certs",
        metavar="FILE",
        help=f"the CA certificates that HTTPS {them} are verified against (default: the "
        "system's store, and SSL_CERT_FILE)",
    )
    add_env_flag(
        parser,
        f"{prefix}-certfile",
        metavar="FILE",
        help=f"a client certificate for HTTPS {them} that require one (vLLM's --ssl-cert-reqs 2)",
    )
    add_env_flag(
        parser, f"{prefix}-keyfile", metavar="FILE", help=f"the private key of --{prefix}-certfile"
    )


def client_tls_from_args(args: argparse.Namespace, prefix: str) -> ssl.SSLContext:
    """``client_context`` of the ``--{prefix}-…`` flags."""
    attr = prefix.replace("-", "_")
    return client_context(
        getattr(args, f"{attr}_ca_certs"),
        getattr(args, f"{attr}_certfile"),
        getattr(args, f"{attr}_keyfile"),
        prefix,
    )


def client_context(
    ca_certs: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    prefix: str = "upstream",
) -> ssl.SSLContext:
    """The context for HTTPS connections to engines; raises ValueError naming the flag
    (``--{prefix}-…``) whose file does not load."""
    if keyfile is not None and certfile is None:
        raise ValueError(f"--{prefix}-keyfile needs --{prefix}-certfile")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificates and host names
    if ca_certs is None:
        context.load_default_certs()  # the system's store, SSL_CERT_FILE, SSL_CERT_DIR
    else:
        _load_cas(context, ca_certs, f"--{prefix}-ca-certs")
    if certfile is not None:
        _load_chain(context, certfile, keyfile, f"--{prefix}-certfile", f"--{prefix}-keyfile")
    return context


def tls_failure(exc: BaseException, prefix: str, shows_certificate: bool) -> str | None:
    """Why a call to an HTTPS server failed, with the ``--{prefix}-…`` flag that fixes
    it, when TLS is the likely why; None otherwise. ``shows_certificate``: whether the
    caller has a client certificate to show.

    A server that wants a client certificate and gets none ends the TLS 1.3 handshake
    after the client thinks it done: the client sees the connection closed before an
    answer, not a TLS error."""
    var = env_var(f"{prefix}-ca-certs")
    wants = f"--{prefix}-certfile and --{prefix}-keyfile"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (
                f"its certificate does not verify ({cause.verify_message}): name the CA "
                f"that signed it with --{prefix}-ca-certs (env {var})"
            )
        if isinstance(cause, ssl.SSLError):
            return (
                f"its TLS handshake fails ({cause.reason or cause}): check that it serves "
                f"HTTPS at this URL; one that wants a client certificate needs {wants}"
            )
        cause = cause.__cause__ or cause.__context__
    if not shows_certificate and isinstance(exc, httpx.RemoteProtocolError):
        return (
            "it closes HTTPS connections without an answer, as a server that wants a client "
            f"certificate does (vLLM's --ssl-cert-reqs 2): give it one with {wants}"
        )
    return None


def _load_chain(
    context: ssl.SSLContext, cert: str, key: str | None, cert_flag: str, key_flag: str
) -> None:
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        missing = key_flag if key is not None and exc.filename == key else cert_flag
        raise ValueError(f"{missing}: no such file {exc.filename or cert}") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"{cert_flag} {cert}"
            + (f" with {key_flag} {key}" if key else "")
            + f" does not load: {exc}"
        ) from None


def _load_cas(context: ssl.SSLContext, cafile: str, flag: str) -> None:
    try:
        context.load_verify_locations(cafile=cafile)
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such file {cafile}") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{flag} {cafile} does not load: {exc}") from None


def _copy(path: str | None, directory: str, name: str) -> str | None:
    if path is None:
        return None
    target = os.path.join(directory, name)
    shutil.copyfile(path, target)
    return target


class TLSFiles:
    """The files a TLS context was loaded from, reloaded into it when one changes.

    A change is a new (inode, size, mtime) of the file a path names, symlinks followed:
    Kubernetes swaps a secret's files by renaming a link. A new certificate and key are
    copied, then loaded into a scratch context from the copies, then into the one in use
    from the same copies: a pair caught half-replaced (the certificate new, the key old)
    leaves the context in use as it was (OpenSSL would drop its key on the mismatch, and
    it would then serve no cipher), and is tried again at the next change. CAs are added to the ones
    the context trusts (OpenSSL cannot remove one), so old and new both verify through a
    CA's rotation."""

    __slots__ = ("_seen", "ca_certs", "certfile", "context", "keyfile", "what")

    def __init__(
        self,
        context: ssl.SSLContext,
        certfile: str | None,
        keyfile: str | None,
        ca_certs: str | None,
        what: str,
    ) -> None:
        self.context = context
        self.certfile = certfile
        self.keyfile = keyfile
        self.ca_certs = ca_certs
        self.what = what  # whose files, for the log: "served", "upstream", "engine"
        self._seen = self._stamp()

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.certfile, self.keyfile, self.ca_certs) if p is not None]

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self.paths:
            try:
                st = os.stat(path)
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def check(self) -> bool:
        """Reload the files if one changed since the last check; True when it did. Files
        that do not load keep the context as it was, and are named once per change."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        # Copies, so that what is checked is what is loaded, whatever changes meanwhile.
        with tempfile.TemporaryDirectory(prefix="prefixgate-tls-") as scratch_dir:
            try:
                cert, key, cas = (
                    _copy(path, scratch_dir, name)
                    for path, name in (
                        (self.certfile, "cert"),
                        (self.keyfile, "key"),
                        (self.ca_certs, "cas"),
                    )
                )
                if cert is not None:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
                if cas is not None:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cas)
            except (ssl.SSLError, OSError) as exc:
                log.warning(
                    "%s TLS files changed but do not load (%s): kept the old ones", self.what, exc
                )
                return False
            if cert is not None:
                self.context.load_cert_chain(cert, key)
            if cas is not None:
                self.context.load_verify_locations(cas)
        log.info("%s TLS files reloaded: %s", self.what, ", ".join(self.paths))
        return True

    async def watch(self) -> None:
        """``check`` every ``REFRESH_S``, in the event loop that makes the handshakes."""
        while True:
            await asyncio.sleep(REFRESH_S)  # the check period
            try:
                self.check()
            except Exception:  # a reload bug must not end the watch
                log.exception("%s TLS files: reload failed", self.what)
