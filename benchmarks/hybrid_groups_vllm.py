"""Hybrid models' KV-cache groups: does the bridge see what vLLM's cache would hit?

    .venv/bin/python benchmarks/hybrid_groups_vllm.py --engine-python /work/vllm-venv/bin/python \
        --tree before=DIR --tree after=.

vLLM caches a hybrid model (gpt-oss, Gemma 3: sliding-window layers beside full-attention
ones; Qwen3-Next: linear-attention ones, Mamba-kind) in several KV-cache groups, each
publishing its own events. Its CPU build runs one
group only (the hybrid manager is GPU-only), so this drives vLLM's own scheduler-side
KV-cache manager (``vllm.v1.core.kv_cache_manager.KVCacheManager``, no model needed) with
the groups vLLM forms for the layer layout, and publishes its events encoded as vLLM's
ZMQ publisher encodes them. Per tree (``PYTHONPATH``): ``--replicas`` such managers, a
``bridge.translate.KeyTranslator`` per replica fed with the decoded events, and a router
that sends each request to the replica whose published keys match the longest prefix
(ties: the replica with the fewest requests). Workload: ``--requests`` single questions
on ``--docs`` documents of 600–2,000 tokens, Zipf popularity, one at a time. Printed per
layout and pool: the prompt tokens vLLM found cached (its ``get_computed_blocks``), the
tokens the router predicted for the replica it chose, and how often the two agree.

The vLLM side runs under ``--engine-python`` (``--vllm-side``), the rest under this
interpreter; they talk over a pipe, one JSON line per request.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

BLOCK = 16
LAYOUTS = {  # layer kinds in order, as each model's config lists them
    "gpt-oss": ["sliding", "full"] * 12,
    "gemma3": (["sliding"] * 5 + ["full"]) * 4,
    "qwen3-next": (["mamba"] * 3 + ["full"]) * 6,  # linear-attention layers: Mamba kind
    "full": ["full"] * 24,
}


# ------------------------------------------------------------------------- vLLM side


def vllm_side(layout: str, num_blocks: int, replicas: int) -> None:
    """Serves requests on ``replicas`` vLLM KV-cache managers: reads ``{"replica",
    "prompt"}`` lines, answers ``{"hit", "payload"}`` (the step's events, msgpack)."""
    import msgspec
    import torch
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        _get_kv_cache_groups_uniform_page_size,
        get_request_block_hasher,
        init_none_hash,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    shape = {"block_size": BLOCK, "num_kv_heads": 8, "head_size": 64, "dtype": torch.bfloat16}
    page = 2 * BLOCK * 8 * 64 * 2  # an attention block's bytes: a Mamba state is padded to it
    kinds = {
        "full": lambda: FullAttentionSpec(**shape),
        "sliding": lambda: SlidingWindowSpec(**shape, sliding_window=128),
        # vLLM's default with prefix caching: a state kept where a step ends on a block
        "mamba": lambda: MambaSpec(
            block_size=BLOCK,
            shapes=((4, 64),),
            dtypes=(torch.bfloat16,),
            page_size_padded=page,
            mamba_cache_mode="align",
        ),
    }
    specs = {f"model.layers.{i}.attn": kinds[kind]() for i, kind in enumerate(LAYOUTS[layout])}
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    managers = [
        KVCacheManager(
            config,
            max_model_len=8192,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        for _ in range(replicas)
    ]
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    encoder = msgspec.msgpack.Encoder()
    names = [type(g.kv_cache_spec).__name__ for g in groups]
    print(json.dumps({"groups": names}), flush=True)
    for n, line in enumerate(sys.stdin):
        ask = json.loads(line)
        mgr, prompt = managers[ask["replica"]], ask["prompt"]
        req = Request(f"r{n}", prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit, _ = mgr.get_computed_blocks(req)
        done, first = hit, True
        while done < len(prompt):  # chunked prefill, 512 tokens a step
            chunk = min(512, len(prompt) - done)
            mgr.new_step_starts()
            got = mgr.allocate_slots(
                req,
                chunk,
                num_new_computed_tokens=hit if first else 0,
                new_computed_blocks=blocks if first else None,
            )
            assert got is not None, "the pool cannot hold one request"
            done, first = done + chunk, False
            req.num_computed_tokens = done
        for token in range(8):  # a short answer
            req.append_output_token_ids(100 + token)
            mgr.new_step_starts()
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        mgr.free(req)
        batch = KVEventBatch(ts=float(n), events=mgr.take_events())
        payload = base64.b64encode(encoder.encode(batch)).decode()
        print(json.dumps({"hit": hit, "payload": payload}), flush=True)


# -------------------------------------------------------------------- prefixgate side


def prefixgate_side(args: argparse.Namespace, layout: str, num_blocks: int) -> dict[str, Any]:
    from bridge.events import BlockRemoved, BlockStored, decode_batch
    from bridge.translate import KeyTranslator
    from router.protocol import KeySpace, short_key

    cmd = [args.engine_python, __file__, "--vllm-side", layout, str(num_blocks)]
    cmd += ["--replicas", str(args.replicas)]
    engine = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_vllm_env()
    )
    assert engine.stdin is not None and engine.stdout is not None
    groups = json.loads(engine.stdout.readline())["groups"]
    translators = [KeyTranslator("m", BLOCK) for _ in range(args.replicas)]
    sent = [0] * args.replicas
    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(100, 40_000) for _ in range(rng.randrange(600, 2_000))]
        for _ in range(args.docs)
    ]
    weights = [1 / (i + 1) ** 1.1 for i in range(args.docs)]
    out = {"exact": 0, "under": 0, "over": 0, "hit": 0, "predicted": 0, "prompt": 0}
    for _ in range(args.requests):
        doc = rng.choices(range(args.docs), weights)[0]
        prompt = docs[doc] + [rng.randrange(100, 40_000) for _ in range(30)]
        keys = [short_key(k) for k in KeySpace("m", BLOCK, "").keys(prompt)]
        matches = [_matched(tr, keys) for tr in translators]
        replica = max(range(args.replicas), key=lambda r: (matches[r], -sent[r]))
        sent[replica] += 1
        # vLLM computes a prompt's last token again: at most len - 1 tokens hit, whole blocks.
        predicted = min(matches[replica] * BLOCK, len(prompt) - 1) // BLOCK * BLOCK
        engine.stdin.write(json.dumps({"replica": replica, "prompt": prompt}) + "\n")
        engine.stdin.flush()
        answer = json.loads(engine.stdout.readline())
        hit = answer["hit"]
        out["exact" if predicted == hit else "under" if predicted < hit else "over"] += 1
        out["hit"] += hit
        out["predicted"] += predicted
        out["prompt"] += len(prompt)
        tr = translators[replica]
        for event in decode_batch(base64.b64decode(answer["payload"])).events:
            if isinstance(event, BlockStored):
                tr.stored(event)
            elif isinstance(event, BlockRemoved):
                tr.removed(event)
    engine.stdin.close()
    engine.wait(timeout=60)
    return {"layout": layout, "blocks": num_blocks, "groups": groups, "sent": sent, **out}


def _matched(tr: Any, keys: list[bytes]) -> int:
    """Keys of the prompt, from its start, that ``tr`` publishes on the device."""
    n = 0
    for key in keys:
        if tr.published.tier(key) != "device":
            break
        n += 1
    return n


def _vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "VLLM_LOGGING_LEVEL": "ERROR"}


# ------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--layout", action="append", choices=sorted(LAYOUTS))
    p.add_argument("--num-blocks", action="append", type=int, help="per replica")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-side", nargs=2, metavar=("LAYOUT", "BLOCKS"), help=argparse.SUPPRESS)
    p.add_argument("--one", nargs=2, metavar=("LAYOUT", "BLOCKS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_side:
        vllm_side(args.vllm_side[0], int(args.vllm_side[1]), args.replicas)
        return
    if args.one:
        print(json.dumps(prefixgate_side(args, args.one[0], int(args.one[1]))))
        return
    layouts = args.layout or ["gpt-oss", "gemma3", "qwen3-next", "full"]
    pools = args.num_blocks or [1200, 600]
    trees = [t.split("=", 1) for t in args.tree] or [["this", "."]]
    print(
        "| layout (vLLM's groups) | blocks per replica | tree | vLLM's hits, tokens "
        "| predicted for the chosen replica | exact / under / over | requests per replica |"
    )
    print("| --- | ---: | --- | ---: | ---: | --- | --- |")
    for layout in layouts:
        for blocks in pools:
            for name, tree in trees:
                cmd = [sys.executable, __file__, "--one", layout, str(blocks)]
                for flag in ("engine_python", "replicas", "docs", "requests", "seed"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                r = json.loads(line.stdout.strip().splitlines()[-1])
                share = r["hit"] / r["prompt"]
                print(
                    f"| {layout} ({', '.join(g.removesuffix('Spec') for g in r['groups'])}) "
                    f"| {blocks:,} | {name} | {r['hit']:,} ({share:.1%} of prompts) "
                    f"| {r['predicted']:,} | {r['exact']} / {r['under']} / {r['over']} "
                    f"| {' / '.join(map(str, r['sent']))} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
