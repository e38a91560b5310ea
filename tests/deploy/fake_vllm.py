"""Stands in for ``python -m vllm.entrypoints.openai.api_server`` under ``prefixgate up
--engine vllm`` in tests: parses the flags ``up`` passes, serves the engine's HTTP side
(``/health``, ``/v1/models``, ``/metrics``, ``/tokenize``) on ``--port`` and publishes
KV events in vLLM's format on the ``--kv-events-config`` endpoints, until SIGTERM."""

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
    args, _ = p.parse_known_args()
    assert args.module == "vllm.entrypoints.openai.api_server"
    events = json.loads(args.kv_events_config)
    tokenizer = ChatTokenizer.from_dir(__import__("pathlib").Path(args.model))
    http = FakeEngineHTTP(args.served_model_name, tokenizer.encode_chat, VLLM_METRICS, args.port)
    engine = FakeEngine(events["endpoint"], events["replay_endpoint"], 16)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine.start()
    http.start()
    print(f"fake vllm serving {args.served_model_name} on {args.port}", flush=True)
    stop.wait()
    http.stop()
    engine.close()


if __name__ == "__main__":
    main()
