"""The servers' uvicorn ``Server``, with what TLS needs beyond uvicorn's options.

* Its TLS files are reloaded when they change (``prefixgate.tls.TLSFiles``): a
  certificate rotated on disk is served without a restart.
* ``settle_heap``: once serving, the garbage collector is set for a server's heap
  (``prefixgate.gc_heap``).
* A client must finish its TLS handshake within ``handshake_timeout_s`` (the HTTP
  guard's header timeout), as it must send its request head in time. uvicorn leaves the
  event loop's default of 60 s, and the guard only sees a connection once its handshake
  is done: a client that connects and sends nothing held its descriptor six times as
  long on HTTPS as on HTTP, outside the guard's count of connections.

Imported by the CLIs once they start serving: uvicorn costs ``--help`` time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket

import uvicorn

from prefixgate import gc_heap
from prefixgate.tls import TLSFiles

log = logging.getLogger("prefixgate.serve")


class Server(uvicorn.Server):
    _tls_watch: asyncio.Task[None] | None = None

    def __init__(
        self,
        config: uvicorn.Config,
        handshake_timeout_s: float = 10.0,
        settle_heap: bool = False,
    ) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s
        self.settle_heap = settle_heap

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self._start(sockets)  # the app's lifespan start-up, then the listeners
        if self.settle_heap and self.started:
            frozen = gc_heap.settle()
            log.info(
                "garbage collector: %d start-up objects frozen, youngest generation "
                "collected after %d",
                frozen,
                gc_heap.GEN0_THRESHOLD,
            )

    async def _start(self, sockets: list[socket.socket] | None) -> None:
        config = self.config  # loaded by uvicorn's serve() before this
        context = getattr(config, "ssl", None)  # set by Config.load() when serving HTTPS
        if context is None:
            await super().startup(sockets=sockets)
            return
        # uvicorn creates its listening sockets with the loop's create_server and no
        # handshake timeout: give it one, for this call only.
        loop = asyncio.get_running_loop()
        loop.create_server = functools.partial(  # type: ignore[method-assign]
            loop.create_server, ssl_handshake_timeout=self.handshake_timeout_s
        )
        try:
            await super().startup(sockets=sockets)
        finally:
            del loop.create_server  # the loop's own method again
        if config.ssl_certfile:
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
