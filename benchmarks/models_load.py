"""Model and tokenizer start-up costs: the once-only builds and the warm loads.

    .venv/bin/python benchmarks/models_load.py [--smollm2]

Cold builds go to a temporary PREFIXGATE_CACHE; ``--smollm2`` also times the one-time
GGUF conversion there (tens of seconds). Warm figures use the default cache.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")


def timed(label: str, action: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = action()
    print(f"{label:<48} {time.perf_counter() - start:8.3f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smollm2", action="store_true", help="also time the cold conversion")
    args = parser.parse_args()

    from prefixgate.tokenizer import ChatTokenizer

    default_cache = os.environ.pop("PREFIXGATE_CACHE", None)
    with tempfile.TemporaryDirectory() as cold:
        os.environ["PREFIXGATE_CACHE"] = cold
        timed(
            "tokenizer: extract from GGUF + load (cold)",
            lambda: ChatTokenizer.for_model("tiny-random"),
        )
        from replica.models import load_model  # torch + transformers import is not counted below

        timed("tiny-random: build + load (cold)", lambda: load_model("tiny-random"))
        if args.smollm2:
            timed("smollm2-135m: convert GGUF + load (cold)", lambda: load_model("smollm2-135m"))
    if default_cache is None:
        del os.environ["PREFIXGATE_CACHE"]
    else:
        os.environ["PREFIXGATE_CACHE"] = default_cache

    tokenizer = timed("tokenizer: load (warm)", lambda: ChatTokenizer.for_model("smollm2-135m"))
    timed("tiny-random: load (warm)", lambda: load_model("tiny-random"))
    timed("smollm2-135m: load (warm; converts if never done)", lambda: load_model("smollm2-135m"))

    system = " ".join(f"Rule {i}: answer politely and cite sources." for i in range(250))
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "What is 2+2?"}]
    ids = tokenizer.encode_chat(chat)
    rounds = 50
    start = time.perf_counter()
    for _ in range(rounds):
        tokenizer.encode_chat(chat)
    per_call = (time.perf_counter() - start) / rounds
    print(f"encode_chat of a {len(ids)}-token chat: {per_call * 1e3:.2f} ms per call")


if __name__ == "__main__":
    main()
