"""``prefixgate up``: the commands it builds, its process stack, and a whole local cluster.

The end-to-end test runs the real command in a subprocess (embedded Redis, two
``tiny-random`` replicas, the gateway), talks to it with the official ``openai`` client
and with ``prefixgate chat``, then sends SIGTERM and checks that no child process and no
listening port is left.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from openai import OpenAI

from prefixgate import cli, up
from prefixgate.procs import free_port, http_ok
from prefixgate.stack import PIDS_FILE, Stack
from tests.conftest import wait_until

# Long enough for several full 16-token blocks whatever the chat template adds.
SYSTEM = (
    "You are a careful assistant for a test suite. Answer in one short sentence, "
    "never use lists, and keep every answer polite, plain and free of jargon. "
    "The user is checking that a prefix cache works across two identical turns."
)


class Listed(NamedTuple):
    name: str
    pid: int
    port: int


def read_pids(run_dir: Path) -> list[Listed]:
    rows = (line.split() for line in (run_dir / PIDS_FILE).read_text().splitlines())
    return [Listed(name, int(pid), int(port)) for name, pid, port in rows]


def group_alive(pgid: int) -> bool:
    """Any running process in group ``pgid``. Zombies do not count: they hold no memory or
    port, and an orphan's zombie waits on PID 1, which need not reap it in a sandbox."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
        state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def up_command(port: int, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "prefixgate", "up", "--port", str(port), "--run-dir", str(run_dir),
        "--stop-grace-s", "15", *extra,
    ]  # fmt: skip


# --------------------------------------------------------------------------- commands


def test_commands_are_accepted_by_the_real_replica_and_gateway_parsers(tmp_path: Path) -> None:
    from gateway.cli import build_parser as gateway_parser
    from replica.cli import build_parser as replica_parser

    keys = tmp_path / "keys.yaml"
    keys.write_text("sk-a: {tenant: a}\n")
    args = up.parse_args(
        ["--device", "cuda", "--replicas", "3", "--num-blocks", "64", "--api-keys", str(keys)]
    )
    redis = "redis://127.0.0.1:6390/0"
    for i in range(3):
        cmd = up.replica_command(args, i, 9000 + i, redis)
        assert cmd[:4] == [sys.executable, "-m", "prefixgate", "replica"]
        parsed = replica_parser().parse_args(cmd[4:])
        assert (parsed.device, parsed.port, parsed.num_blocks) == (f"cuda:{i}", 9000 + i, 64)
        assert parsed.replica_id is None  # named by its address, as the gateway names it
        assert parsed.advertise_url == f"http://127.0.0.1:{9000 + i}"
        assert parsed.redis_url == redis
    urls = ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    cmd = up.gateway_command(args, urls, redis)
    assert cmd[:4] == [sys.executable, "-m", "prefixgate", "gateway"]
    parsed = gateway_parser().parse_args(cmd[4:])
    assert parsed.replica == urls
    assert (parsed.redis_url, parsed.port, Path(parsed.api_keys)) == (redis, 8000, keys)


def test_devices_and_bad_arguments() -> None:
    assert up.replica_device("cuda", 3) == "cuda:3"
    assert up.replica_device("cuda:1", 3) == "cuda:1"
    assert up.replica_device("cpu", 3) == "cpu"
    for bad in (["--replicas", "0"], ["--device", "tpu"], ["--api-keys", "/nonexistent"]):
        with pytest.raises(SystemExit) as exc:
            up.parse_args(bad)
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        up.parse_args(["--kv-cache-mb", "10", "--num-blocks", "10"])


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        up.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in up.build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
    assert "SIGTERM" in text and "run directory" in text


def test_banner_tells_how_to_call_the_gateway(tmp_path: Path) -> None:
    args = up.parse_args(["--model", "tiny-random", "--run-dir", str(tmp_path)])
    text = up.banner(args, "http://127.0.0.1:8123/v1")
    assert "base_url  http://127.0.0.1:8123/v1" in text
    assert "curl http://127.0.0.1:8123/v1/chat/completions" in text
    assert 'OpenAI(base_url="http://127.0.0.1:8123/v1"' in text
    assert "prefixgate chat" in text
    assert 'model="tiny-random"' in text


def test_banner_names_the_model_as_served(tmp_path: Path) -> None:
    """With --served-model-name the replicas serve those names only (as vLLM): the banner
    told clients to call the model's own name, a 404."""
    names = ["--served-model-name", "gpt-4o-mini", "chat"]
    args = up.parse_args(["--model", "tiny-random", *names, "--run-dir", str(tmp_path)])
    text = up.banner(args, "http://127.0.0.1:8123/v1")
    assert 'model="gpt-4o-mini"' in text and '"model": "gpt-4o-mini"' in text
    assert "--model gpt-4o-mini" in text  # prefixgate chat is told which of the two
    assert 'tiny-random"' not in text


def test_a_busy_port_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert up.main(["--port", str(port), "--run-dir", str(tmp_path)]) == 1
    assert f"port(s) [{port}] already in use" in capsys.readouterr().err
    assert not (tmp_path / PIDS_FILE).exists()  # nothing was started
    assert up.can_listen(port, "127.0.0.1")  # and once released, it is free again


# --------------------------------------------------------------------------- process stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(run_dir=tmp_path, env=dict(os.environ))
    yield s
    s.stop_all(grace_s=2)


def test_stop_all_ends_each_whole_process_group(stack: Stack) -> None:
    # A shell whose own child (the sleep in the background) must not be orphaned.
    stack.start("shell", ["sh", "-c", "sleep 60 & wait"], port=0)
    stack.start("python", [sys.executable, "-c", "import time; time.sleep(60)"], port=0)
    pids = read_pids(stack.run_dir)
    assert [p.name for p in pids] == ["shell", "python"]
    assert all(group_alive(p.pid) for p in pids)
    stack.stop_all(grace_s=5)
    # stop_all waits for each leader it started; the background sleep is no child of it,
    # and a signalled process exits when the scheduler next runs it (on a loaded machine,
    # after kill() has returned): poll for it, well inside the sleep's 60 s.
    wait_until(
        lambda: not any(group_alive(p.pid) for p in pids),
        timeout_s=10,
        what="no running process left in either group",
    )


def test_stop_all_kills_a_child_that_ignores_sigterm(stack: Stack) -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "print('ready', flush=True); time.sleep(60)"
    child = stack.start("stubborn", [sys.executable, "-c", code], port=0)
    wait_for_log(child.log_path, "ready", child.proc)
    stack.stop_all(grace_s=0.5)
    assert child.proc.returncode == -signal.SIGKILL


def test_later_stages_stop_first(stack: Stack, tmp_path: Path) -> None:
    """The gateway (stage 2) is gone before replicas (1) get SIGTERM, and they before Redis (0)."""
    order = tmp_path / "order"
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    for name, stage in [("redis", 0), ("replica-0", 1), ("replica-1", 1), ("gateway", 2)]:
        child = stack.start(name, [sys.executable, "-c", code, name], port=0, stage=stage)
        wait_for_log(child.log_path, "ready", child.proc)
    stack.stop_all(grace_s=5)
    stopped = order.read_text().split()
    assert stopped[0] == "gateway" and stopped[-1] == "redis"
    assert sorted(stopped[1:3]) == ["replica-0", "replica-1"]


def test_a_dying_child_is_reported_with_its_log(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    code = "print('about to fail: no GPU here'); raise SystemExit(3)"
    stack.start("doomed", [sys.executable, "-c", code], port=0)
    assert stack.supervise() == 1
    err = capsys.readouterr().err
    assert "doomed" in err and "exited with code 3" in err and "no GPU here" in err


def test_a_signal_ends_supervision_cleanly(stack: Stack) -> None:
    stack.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], port=0)
    stack.on_signal(signal.SIGTERM, None)
    assert stack.supervise() == 0
    assert stack.stop_signal == "SIGTERM"


def stop_up(proc: subprocess.Popen[bytes], out_path: Path, listed: list[Listed]) -> None:
    """SIGTERM a ``prefixgate up`` still running: it must exit 0 (its output in the
    failure) and leave none of ``listed`` running."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 0, out_path.read_text()
    for child in listed:
        assert not group_alive(child.pid), f"{child.name} (pid {child.pid}) outlived up"


def while_running(done: Callable[[], bool], proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    """``done`` as a probe for ``wait_until`` that fails at once if ``proc`` has exited."""

    def probe() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode} while we waited"
        return done()

    return probe


def wait_for_log(path: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    """A child without a health endpoint says it is ready in its log."""
    wait_until(while_running(lambda: text in path.read_text(), proc), 30, f"{text!r} in {path}")


# --------------------------------------------------------------------------- end to end


def test_up_serves_caches_and_stops_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    out_path = tmp_path / "up.out"
    cmd = up_command(port, run_dir, "--replicas", "2", "--model", "tiny-random")
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        # `up` writes run_dir/ready once every replica and the gateway answer.
        wait_until(while_running((run_dir / "ready").exists, proc), 180, "run_dir/ready")
        base_url = f"http://127.0.0.1:{port}/v1"
        assert (run_dir / "ready").read_text().strip() == base_url
        assert http_ok(f"http://127.0.0.1:{port}/ready")
        assert "prefixgate is up" in out_path.read_text()
        listed = read_pids(run_dir)
        assert [p.name for p in listed] == ["redis", "replica-0", "replica-1", "gateway"]

        client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Say hello."},
        ]
        turns = []
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny-random",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
                extra_headers={"X-Conversation-Id": "test-up"},
            )
            completion = raw.parse()
            assert completion.usage is not None and completion.usage.prompt_tokens > 16
            details = completion.usage.prompt_tokens_details
            turns.append(
                (raw.headers["x-prefixgate-replica"], details.cached_tokens if details else 0)
            )
        (first_replica, _), (second_replica, second_cached) = turns
        # One id per replica, its address, whether the gateway saw it as a static --replica
        # or in the Redis registry.
        addresses = {f"127.0.0.1:{p.port}" for p in listed if p.name.startswith("replica-")}
        assert first_replica in addresses
        assert second_replica == first_replica
        assert second_cached is not None and second_cached > 0

        # `prefixgate chat`, in-process (a new interpreter per call costs seconds here).
        # Each call is new work, which the router spreads over both replicas; by the
        # third call both hold the system prompt, wherever it goes.
        for _ in range(3):
            assert cli.main(["chat", SYSTEM, "--base-url", base_url, "--max-tokens", "4"]) == 0
        printed = capsys.readouterr().out
        found = re.search(r"\[replica (\S+) · prompt tokens (\d+) · cached (\d+)\]$", printed)
        assert found, printed
        assert found[1] in addresses and int(found[3]) > 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    output = out_path.read_text()
    assert code == 0, output
    assert "all processes stopped" in output
    for child in listed:
        assert not group_alive(child.pid), f"{child.name} (pid {child.pid}) outlived up"
        assert up.can_listen(child.port, "127.0.0.1"), f"{child.name}'s port is still bound"


def test_up_reports_a_child_that_dies_and_stops_the_rest(tmp_path: Path) -> None:
    # No such model: the gateway (no tokenizer) and the replica (no weights) both exit.
    run_dir = tmp_path / "run"
    missing = tmp_path / "no-such-model"
    cmd = up_command(free_port(), run_dir, "--replicas", "1", "--model", str(missing))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    found = re.search(r"prefixgate up: (\S+) \(pid \d+\) exited with code", result.stderr)
    assert found, result.stderr
    dead_log = (run_dir / f"{found[1]}.log").read_text().strip().splitlines()
    assert dead_log[-1] in result.stderr  # the tail of the dead child's own log
    assert "all processes stopped" in result.stdout
    for child in read_pids(run_dir):
        assert not group_alive(child.pid), f"{child.name} outlived up"
