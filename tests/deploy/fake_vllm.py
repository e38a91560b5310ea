"""Stands in for ``python -m vllm.entrypoints.openai.api_server`` under ``prefixgate up
--engine vllm`` in tests: parses the flags ``up`` passes, serves the engine's HTTP side
(``/health``, ``/v1/models``, ``/metrics``, ``/tokenize``) on ``--port`` and publishes
KV events in vLLM's format on the ``--kv-events-config`` endpoints, until SIGTERM. With
``--data-parallel-size N``, N ranks: each publishes on the endpoints' ports plus its rank,
as vLLM's do, and ``/metrics`` has each rank's gauges (rank r runs 3 + r requests)."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from prefixgate.tokenizer import ChatTokenizer
from tests.bridge.fake_engine import VLLM_METRICS, FakeEngine, FakeEngineHTTP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", dest="module", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-events-config", required=True)
    p.add_argument("--data-parallel-size", type=int, default=1)
    args, _ = p.parse_known_args()
    assert args.module == "vllm.entrypoints.openai.api_server"
    events = json.loads(args.kv_events_config)
    tokenizer = ChatTokenizer.from_dir(__import__("pathlib").Path(args.model))
    ranks = range(args.data_parallel_size)
    metrics = VLLM_METRICS if len(ranks) == 1 else "".join(map(rank_metrics, ranks))
    http = FakeEngineHTTP(args.served_model_name, tokenizer.encode_chat, metrics, args.port)
    engines = [
        FakeEngine(offset(events["endpoint"], r), offset(events["replay_endpoint"], r), 16)
        for r in ranks
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for engine in engines:
        engine.start()
    http.start()
    print(f"fake vllm serving {args.served_model_name} on {args.port}", flush=True)
    stop.wait()
    http.stop()
    for engine in engines:
        engine.close()


def offset(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def rank_metrics(rank: int) -> str:
    labels = f'engine="{rank}",model_name="m"'
    return (
        f"vllm:num_requests_running{{{labels}}} {3 + rank}.0\n"
        f'vllm:cache_config_info{{block_size="128",engine="{rank}",num_gpu_blocks="40"}} 1.0\n'
    )


if __name__ == "__main__":
    main()
