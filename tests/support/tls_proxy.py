"""A TLS front for a plain TCP server, as a managed Redis serves TLS (Azure Cache on 6380,
ElastiCache and Memorystore with in-transit encryption): the ``redis-server`` the tests
run is built without TLS. It terminates TLS with the given certificate (and asks for a
client certificate with ``client_ca``), then relays bytes both ways. Runs its own event
loop in a thread; ``connections`` counts the TLS handshakes that succeeded.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TLSProxy:
    def __init__(
        self, target_port: int, certfile: str, keyfile: str, client_ca: str | None = None
    ) -> None:
        self.target_port = target_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certfile, keyfile)
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
        self.connections = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def _start(self) -> None:
        self._server = await asyncio.start_server(
            self._relay, "127.0.0.1", 0, ssl=self.context, ssl_handshake_timeout=5
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextmanager
def tls_proxy(
    target_port: int, certfile: str, keyfile: str, client_ca: str | None = None
) -> Iterator[TLSProxy]:
    proxy = TLSProxy(target_port, certfile, keyfile, client_ca)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
