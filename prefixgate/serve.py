"""The servers' uvicorn ``Server``, which reloads its TLS files when they change
(``prefixgate.tls.TLSFiles``): a certificate rotated on disk is served without a restart.
Imported by the CLIs once they start serving: uvicorn costs ``--help`` time."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from prefixgate.tls import TLSFiles


class Server(uvicorn.Server):
    _tls_watch: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        config = self.config
        context = getattr(config, "ssl", None)  # set by Config.load() when serving HTTPS
        if context is not None and config.ssl_certfile:
            files = TLSFiles(
                context,
                str(config.ssl_certfile),
                str(config.ssl_keyfile) if config.ssl_keyfile else None,
                str(config.ssl_ca_certs) if config.ssl_ca_certs else None,
                "served",
            )
            self._tls_watch = asyncio.create_task(files.watch())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        await super().shutdown(sockets=sockets)
