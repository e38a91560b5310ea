"""``prefixgate up``: a whole local cluster in one command.

Starts an embedded Redis (unless ``--redis-url``), N replicas and one gateway as child
processes of a ``Stack`` (prefixgate/stack.py); waits for them by polling their health
endpoints; prints how to talk to the gateway; then supervises until Ctrl-C or SIGTERM,
or until a child dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from prefixgate.engines import ENGINES, EnginePorts, bridge_command, engine_env, vllm_command
from prefixgate.envflags import add_env_flag, env_list
from prefixgate.models import DEFAULT_MODEL, SIM_MODEL, model_dir, served_names
from prefixgate.procs import ChildDied, start_redis
from prefixgate.stack import PIDS_FILE, Child, Stack, pick_ports, report_death, write_whole


def connect_host(host: str) -> str:
    """Where local clients reach a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def can_listen(port: int, host: str) -> bool:
    """Whether a server could listen on ``port``: bound the way uvicorn binds, with
    SO_REUSEADDR, so the TIME_WAIT connections of a stack just stopped do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return False
        return True


def replica_device(device: str, index: int) -> str:
    """``cuda`` gives replica i the GPU i; ``cpu`` and ``cuda:N`` are used as given."""
    return f"cuda:{index}" if device == "cuda" else device


def model_needs_conversion(model: str) -> bool:
    """True when ``model`` is the GGUF-shipped default and its converted folder is missing."""
    return model == DEFAULT_MODEL and not model_dir(model).is_dir()


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # N CPU replicas each using every core would thrash; split the cores between them.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.replicas))
    return env


# --------------------------------------------------------------------------- commands


def replica_command(args: argparse.Namespace, index: int, port: int, redis_url: str) -> list[str]:
    url = f"http://{connect_host(args.host)}:{port}"
    cmd = [sys.executable, "-m", "prefixgate", "replica", "--model", args.model]
    if args.served_model_name:
        cmd += ["--served-model-name", *args.served_model_name]
    cmd += ["--host", args.host, "--port", str(port)]
    cmd += ["--device", replica_device(args.device, index)]
    # No --replica-id: the replica then names itself by its address (host:port), the same
    # id the gateway gives it as a static --replica, so both views are one replica.
    cmd += ["--redis-url", redis_url, "--advertise-url", url]
    if args.kv_cache_mb is not None:
        cmd += ["--kv-cache-mb", str(args.kv_cache_mb)]
    if args.num_blocks is not None:
        cmd += ["--num-blocks", str(args.num_blocks)]
    if args.host_cache_mb is not None:
        cmd += ["--host-cache-mb", str(args.host_cache_mb)]
    if args.model == SIM_MODEL and args.sim_profile is not None:
        cmd += ["--sim-profile", args.sim_profile]
    if args.chat_template is not None:
        cmd += ["--chat-template", str(args.chat_template)]
    if args.default_chat_template_kwargs is not None:
        cmd += ["--default-chat-template-kwargs", args.default_chat_template_kwargs]
    if args.exclude_tools_when_tool_choice_none:
        cmd += ["--exclude-tools-when-tool-choice-none"]
    if args.chat_template_content_format is not None:
        cmd += ["--chat-template-content-format", args.chat_template_content_format]
    if args.tool_call_parser is not None:
        cmd += ["--tool-call-parser", args.tool_call_parser]
    return cmd


def _workers(value: str) -> int | str:
    """``--gateway-workers``: a count, or ``auto`` (the gateway's ``--workers auto``)."""
    return "auto" if value.strip().lower() == "auto" else int(value)


def gateway_command(args: argparse.Namespace, replica_urls: list[str], redis_url: str) -> list[str]:
    served = served_names(args.model, args.served_model_name)[0]
    cmd = [sys.executable, "-m", "prefixgate", "gateway", "--model", served]
    if served != args.model:  # names the gateway cannot look up (or its revision's)
        cmd += ["--tokenizer", args.model]
    cmd += ["--host", args.host, "--port", str(args.port), "--redis-url", redis_url]
    for url in replica_urls:
        cmd += ["--replica", url]
    if args.policy is not None:
        cmd += ["--policy", args.policy]
    if args.gateway_workers == "auto" or args.gateway_workers > 1:
        cmd += ["--workers", str(args.gateway_workers)]
    for option in args.router_option or ():
        cmd += ["--router-option", option]
    if args.api_keys is not None:
        cmd += ["--api-keys", str(args.api_keys)]
    if args.chat_template is not None:  # the replicas render with it: keys must agree
        cmd += ["--chat-template", str(args.chat_template)]
    if args.default_chat_template_kwargs is not None:  # so do these
        cmd += ["--default-chat-template-kwargs", args.default_chat_template_kwargs]
    if args.tokenizer_mode is not None:  # and so does the engines' tokenizer
        cmd += ["--tokenizer-mode", args.tokenizer_mode]
    if args.exclude_tools_when_tool_choice_none:  # and what they leave out
        cmd += ["--exclude-tools-when-tool-choice-none"]
    if args.chat_template_content_format is not None:  # and how they hand content over
        cmd += ["--chat-template-content-format", args.chat_template_content_format]
    return cmd


def banner(args: argparse.Namespace, base_url: str) -> str:
    key = f"<a key from {args.api_keys}>" if args.api_keys is not None else "none"
    message = '[{"role": "user", "content": "Hello!"}]'
    name = served_names(args.model, args.served_model_name)[0]  # what is served
    create = f'client.chat.completions.create(model="{name}", messages={message})'
    body = f'{{"model": "{name}", "messages": {message}}}'
    # several names listed: `prefixgate chat` asks which
    chat_model = f" --model {name}" if len(args.served_model_name or ()) > 1 else ""
    size = args.data_parallel_size
    ranks = f" ({size} data-parallel ranks each)" if size > 1 else ""
    return f"""
prefixgate is up: {args.replicas} × {args.model}{ranks} behind one gateway.

  base_url  {base_url}

  curl {base_url}/chat/completions -H 'Authorization: Bearer {key}' \\
       -H 'Content-Type: application/json' -d '{body}'

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="{key}")
  print({create}.choices[0].message.content)

  prefixgate chat "Hello!" --base-url {base_url}{chat_model}
  (run it twice: the second answer reports cached prompt tokens)

logs in {args.run_dir}/ · Ctrl-C stops everything
"""


# --------------------------------------------------------------------------- running


def start_engines(
    stack: Stack, args: argparse.Namespace, ports: list[int], host: str, redis_url: str
) -> None:
    """``--engine vllm``: replica i is a vLLM server plus a bridge (prefixgate/engines.py);
    its name stays replica-i, so readiness, logs and shutdown are those of any replica."""
    taken = {args.port, *ports}
    ranks = args.data_parallel_size
    for i, port in enumerate(ports):
        # A rank publishes on the event and replay ports plus its rank: a run of each.
        events, replay = pick_ports(2, taken=taken, run=ranks)
        taken |= {*range(events, events + ranks), *range(replay, replay + ranks)}
        engine = EnginePorts(port, events, replay)
        env = engine_env(args, i, stack.env)
        stack.start(f"replica-{i}", vllm_command(args, engine), port, stage=1, env=env)
        for rank in range(ranks) if ranks > 1 else (None,):
            name = f"bridge-{i}" if rank is None else f"bridge-{i}-dp{rank}"
            command = bridge_command(args, engine, host, redis_url, rank)
            stack.start(name, command, 0, stage=2)


def run(stack: Stack, args: argparse.Namespace) -> int:
    host = connect_host(args.host)
    fixed = [args.port]
    if args.replica_base_port is not None:
        fixed += [args.replica_base_port + i for i in range(args.replicas)]
    busy = [p for p in fixed if not can_listen(p, host)]
    if busy:
        print(f"prefixgate up: port(s) {busy} already in use; choose others", file=sys.stderr)
        return 1
    replica_ports = fixed[1:] or pick_ports(args.replicas, taken={args.port})

    redis_url = args.redis_url
    if redis_url is None:
        (redis_port,) = pick_ports(1, taken={args.port, *replica_ports})
        redis_log = stack.run_dir / "redis.log"
        proc = start_redis(redis_port, stack.run_dir / "redis", log_path=redis_log)
        stack.add(Child("redis", proc, redis_log, redis_port, stage=0))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        print(f"  redis ready at {redis_url}", flush=True)
    if stack.stop_signal is not None:  # Ctrl-C while Redis started: start nothing more
        return 0

    replica_urls = [f"http://{host}:{p}" for p in replica_ports]
    if args.engine != "prefixgate":
        start_engines(stack, args, replica_ports, host, redis_url)
    for i, port in enumerate(replica_ports if args.engine == "prefixgate" else ()):
        stack.start(f"replica-{i}", replica_command(args, i, port, redis_url), port, stage=1)
    # Started alongside the replicas, so that its start-up overlaps their model loading.
    stack.start("gateway", gateway_command(args, replica_urls, redis_url), args.port, stage=2)
    print(f"  started {args.replicas} replica(s) of {args.model} and the gateway", flush=True)
    if model_needs_conversion(args.model) and args.engine == "prefixgate":
        print(f"  converting {args.model} to safetensors (first start only)…", flush=True)

    gateway_url = f"http://{host}:{args.port}"
    health = {f"replica-{i}": f"{url}/health" for i, url in enumerate(replica_urls)}
    if not stack.wait_ready(health, args.ready_timeout_s):
        return 0 if stack.stop_signal is not None else 1
    # Every replica healthy in the gateway's eyes, not just answering: a replica takes
    # traffic once the gateway's own probe has reached it, and the first requests would
    # otherwise all go to the replicas that happened to be probed first.
    # An engine's data-parallel ranks are replicas each, once their bridges register.
    ready_url = f"{gateway_url}/ready?min_replicas={args.replicas * args.data_parallel_size}"
    if not stack.wait_ready({"gateway": ready_url}, args.ready_timeout_s):
        return 0 if stack.stop_signal is not None else 1
    print(banner(args, f"{gateway_url}/v1"), flush=True)
    write_whole(stack.run_dir / "ready", f"{gateway_url}/v1\n")
    return stack.supervise()


# --------------------------------------------------------------------------- command line

DESCRIPTION = """\
Start a local prefixgate cluster: an embedded Redis (no persistence; skipped with
--redis-url), N replicas and one gateway, each a child process with its own log in the
run directory. Waits until every replica's /health answers and the gateway sees every
replica healthy (/ready?min_replicas=N), then prints the base_url and how to call it.

With --engine vllm each replica is a vLLM server (--engine-python names the Python that
has vllm installed; --engine-arg passes flags through) with KV-cache events on, and a
`prefixgate bridge` beside it (bridge-<i>.log) that publishes its cache to Redis.

Ctrl-C or SIGTERM stops every child: the gateway, then the replicas, then Redis (SIGTERM,
then SIGKILL after --stop-grace-s). If a child dies, its log tail is printed, the rest
are stopped and `up` exits with 1.

The run directory holds redis.log, replica-<i>.log, gateway.log, `pids` (name pid port
per line) and `ready` (the base_url, written once the cluster serves). Children inherit
the environment, so PREFIXGATE_* variables reach them (e.g. PREFIXGATE_CACHE, where
smollm2-135m is converted to safetensors on first start).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefixgate up",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add("--replicas", metavar="N", type=int, default=2, help="number of replicas (default 2)")
    add(
        "--model",
        metavar="NAME",
        default=DEFAULT_MODEL,
        help=f"model every replica serves: {DEFAULT_MODEL} (default), tiny-random, "
        f"a local Hugging Face model folder, or {SIM_MODEL} (the simulated engine: a GPU "
        "cost model in place of the forward pass, torch-free, dozens per machine)",
    )
    add(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=env_list("served-model-name"),
        help="the model names clients send (the replicas' --served-model-name): a client "
        "that asks for gpt-4o-mini is served with `--served-model-name smollm2-135m "
        "gpt-4o-mini`; the first names answers (env PREFIXGATE_SERVED_MODEL_NAME, "
        "comma-separated; default: --model)",
    )
    add_env_flag(
        p,
        "sim-profile",
        metavar="NAME",
        help=f"with --model {SIM_MODEL}: the replicas' GPU cost profile or profile .json "
        "(the replica's default when unset; cost overrides: PREFIXGATE_SIM_* variables)",
    )
    add(
        "--engine",
        choices=ENGINES,
        default="prefixgate",
        help="the replicas' engine: prefixgate (default) or vllm (its OpenAI server with KV "
        "events, plus a `prefixgate bridge` per replica; engines take minutes to start)",
    )
    add(
        "--engine-arg",
        metavar="ARGS",
        action="append",
        help="with --engine vllm: extra engine flags, e.g. '--max-model-len 4096' (repeatable)",
    )
    add(
        "--data-parallel-size",
        metavar="N",
        type=int,
        default=1,
        help="with --engine vllm: data-parallel ranks per engine (its --data-parallel-size; "
        "with --device cuda, N GPUs each), each a replica of its own with a bridge each",
    )
    add_env_flag(
        p,
        "engine-python",
        metavar="PATH",
        help="with --engine vllm: the Python that has vllm installed (default: this one)",
    )
    add(
        "--device",
        metavar="DEV",
        default="cpu",
        help="cpu (default); cuda gives replica i the GPU i; cuda:N puts every replica on GPU N",
    )
    add("--host", metavar="ADDR", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    add("--port", metavar="PORT", type=int, default=8000, help="gateway port (default 8000)")
    add(
        "--replica-base-port",
        metavar="P",
        type=int,
        default=None,
        help="replica i listens on P+i (default: free ports)",
    )
    add("--redis-url", metavar="URL", default=None, help="use this Redis; no embedded one")
    add("--policy", metavar="NAME", default=None, help="gateway routing policy (its default)")
    add(
        "--gateway-workers",
        metavar="N",
        type=_workers,
        default=1,
        help="gateway processes serving the port (its --workers; default 1): one core of "
        "gateway work each, for many replicas or long streamed answers; auto: one per "
        "CPU the gateway may use",
    )
    add(
        "--router-option",
        metavar="NAME=VALUE",
        action="append",
        help="a router threshold for the gateway, e.g. load_slack=0.5 (repeatable)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-mb", metavar="MB", type=int, help="KV pool per replica")
    budget.add_argument("--num-blocks", metavar="N", type=int, help="KV blocks per replica")
    add(
        "--host-cache-mb",
        metavar="MB",
        type=int,
        help="host-memory KV tier per replica (evicted prefix blocks are kept there and "
        "copied back on a hit; with --model sim the copies cost the profile's PCIe time); "
        "0 = off (the replicas' default when unset)",
    )
    add("--api-keys", metavar="FILE", type=Path, help="gateway API key file (default: no auth)")
    add(
        "--chat-template",
        metavar="FILE",
        type=Path,
        help="jinja chat template instead of the model's own, for the replicas and the "
        "gateway alike (their keys then agree)",
    )
    add(
        "--default-chat-template-kwargs",
        metavar="JSON",
        help='chat template variables where a request sets none, e.g. \'{"enable_thinking": '
        "false}', for the replicas (or engines) and the gateway alike",
    )
    add(
        "--tokenizer-mode",
        choices=["auto", "hf", "mistral"],  # prefixgate/mistral_tokenizer.py TOKENIZER_MODES
        help="with --engine vllm: vLLM's choice between a model's Hugging Face tokenizer and "
        "Mistral's (auto, vLLM's default: Mistral's where the model has Mistral's weights "
        "and tokenizer files), for the engines, their bridges and the gateway alike",
    )
    add(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],  # prefixgate.content_format's options
        help="how a message's content reaches the template (vLLM's flag: auto detects it "
        "from the template), for the replicas (or engines), their bridges and the gateway",
    )
    add(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="render a chat whose tool_choice is none without its tools (vLLM's flag), for "
        "the replicas (or engines) and the gateway alike",
    )
    add(
        "--tool-call-parser",
        choices=["hermes"],
        help="the replicas parse tool calls from the model's text (tool_choice auto)",
    )
    add("--run-dir", metavar="DIR", type=Path, help="logs and pids (default ./runs/<timestamp>)")
    add(
        "--ready-timeout-s",
        metavar="S",
        type=float,
        default=600.0,
        help="give up when not ready after S seconds (default 600)",
    )
    add(
        "--stop-grace-s",
        metavar="S",
        type=float,
        default=15.0,
        help="SIGKILL children still running S seconds after SIGTERM (default 15)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.gateway_workers != "auto" and args.gateway_workers < 1:
        parser.error("--gateway-workers must be at least 1")
    if args.data_parallel_size > 1 and args.engine != "vllm":
        parser.error("--data-parallel-size is for --engine vllm")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        parser.error(f"--device must be cpu, cuda or cuda:N, not {args.device!r}")
    if args.host_cache_mb is not None and args.host_cache_mb < 0:
        parser.error("--host-cache-mb must be >= 0")
    if args.host_cache_mb and args.engine != "prefixgate":
        parser.error(
            "--host-cache-mb is the prefixgate engine's host tier; give the engine's own "
            "offloading flags with --engine-arg"
        )
    if args.tokenizer_mode is not None and args.engine != "vllm":
        parser.error("--tokenizer-mode is vLLM's flag: give it with --engine vllm")
    if args.api_keys is not None and not args.api_keys.is_file():
        parser.error(f"--api-keys {args.api_keys}: no such file")
    if args.chat_template is not None and not args.chat_template.is_file():
        parser.error(f"--chat-template {args.chat_template}: no such file")
    if args.default_chat_template_kwargs is not None:
        from prefixgate.chat_input import template_defaults

        try:
            template_defaults(args.default_chat_template_kwargs)
        except ValueError as exc:
            parser.error(str(exc))
    if args.run_dir is None:
        args.run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    # A reused run directory must not announce the previous run's cluster.
    for stale in ("ready", PIDS_FILE):
        (args.run_dir / stale).unlink(missing_ok=True)
    stack = Stack(run_dir=args.run_dir, env=child_env(args))
    previous = {s: signal.signal(s, stack.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"prefixgate up: logs in {args.run_dir}/", flush=True)
    try:
        return run(stack, args)
    except (ChildDied, TimeoutError, OSError) as exc:
        print(f"prefixgate up: {exc}", file=sys.stderr)
        dead = stack.first_dead()
        if dead is not None:
            report_death(dead)
        return 1
    finally:
        # Signals keep setting the flag (never raising) while the children are stopped.
        stack.stop_all(args.stop_grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("prefixgate up: all processes stopped", flush=True)
