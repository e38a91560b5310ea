"""The open-file budget (prefixgate/open_files.py): the soft limit is raised at start, the
connection cap follows the limit, and running out of descriptors is told apart from a
replica's failure. Limits are set in child processes (this one keeps its own)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

from prefixgate.open_files import connection_cap, out_of_files


def run_limited(code: str, soft: int, hard: int) -> dict[str, object]:
    """Run ``code`` in a child Python whose open-file limit is (soft, hard); its last
    stdout line is JSON."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = """
        import json, resource
        from prefixgate.open_files import prepare_open_files
        files = prepare_open_files(fds_per_connection=2)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(json.dumps({"before": files.before, "limit": files.limit, "soft": soft,
                          "cap": files.max_connections, "text": files.describe()}))
    """
    raised = run_limited(code, 256, 1024)
    assert raised["before"] == 256 and raised["limit"] == raised["soft"] == 1024
    assert raised["cap"] == (1024 - 128) // 2
    assert "raised from 256" in str(raised["text"])
    kept = run_limited(code, 512, 512)  # nothing to raise it to
    assert kept["before"] == kept["limit"] == kept["soft"] == 512
    assert kept["cap"] == (512 - 64) // 2 and "raised" not in str(kept["text"])


def test_the_connection_cap_keeps_a_reserve_and_counts_descriptors_per_connection() -> None:
    assert connection_cap(256, 2) == (256 - 32) // 2
    assert connection_cap(256, 1) == 256 - 32
    assert connection_cap(1 << 20, 2) == ((1 << 20) - 256) // 2  # the reserve stops at 256
    assert connection_cap(4, 2) == 2
    assert connection_cap(resource.RLIM_INFINITY, 2) is None


def test_a_connection_that_fails_for_want_of_a_descriptor_is_not_the_replicas_failure() -> None:
    """With every descriptor taken, the gateway's upstream connect fails as OutOfFiles
    and its health probe gives no verdict; with some free, a refused connection is still
    a ConnectError and a failed probe."""
    code = """
        import asyncio, json, os, socket
        import httpx
        from gateway.http1 import Target, UpstreamError
        from gateway.probes import probe_once
        from gateway.upstream import Upstream

        listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
        port = listener.getsockname()[1]
        closed = socket.create_server(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()

        async def attempt(port):
            upstream = Upstream(4, 2.0, 2.0, 2.0)
            try:
                await upstream._connect(Target(f"http://127.0.0.1:{port}"))
            except UpstreamError as exc:
                return exc.kind
            return "connected"

        async def scenario():
            out = {}
            async with httpx.AsyncClient() as client:
                out["refused"] = await attempt(closed_port)
                closed_url = f"http://127.0.0.1:{closed_port}"
                out["refused_probe"] = await probe_once(client, closed_url, 2.0)
                held = []
                try:
                    while True:
                        held.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    pass
                out["exhausted"] = await attempt(port)
                out["exhausted_probe"] = await probe_once(client, f"http://127.0.0.1:{port}", 2.0)
                for fd in held:
                    os.close(fd)
            return out

        print(json.dumps(asyncio.run(scenario())))
    """
    result = run_limited(code, 64, 64)
    assert result == {
        "refused": "ConnectError",
        "refused_probe": False,
        "exhausted": "OutOfFiles",
        "exhausted_probe": None,
    }


def test_out_of_files_follows_the_chain_of_causes() -> None:
    inner = OSError(24, "Too many open files")
    try:
        try:
            raise inner
        except OSError as exc:
            raise RuntimeError("connect failed") from exc
    except RuntimeError as outer:
        assert out_of_files(outer)
    assert not out_of_files(ConnectionRefusedError(111, "refused"))
    assert not out_of_files(None)
