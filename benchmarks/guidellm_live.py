"""guidellm, the vLLM project's load generator, against a gateway in front of simulated
replicas, per routing policy: what a user measuring prefixgate with it sees.

    .venv/bin/python benchmarks/guidellm_live.py --guidellm /work/clients-venv/bin/guidellm \
        --replicas 8 --policies cache_aware round_robin least_loaded --repeats 2

Per repeat, per policy (interleaved): ``prefixgate up --model sim`` (its default H100
profile) with that ``--policy``, then ``guidellm run`` with ``--streams`` concurrent
conversations of guidellm's synthetic multi-turn data for ``--seconds``: by default the
shape of its ``rhaiis/concurrent-1k-1k-multiturn`` scenario (Red Hat AI Inference
Server's: 5 turns of 1,000 prompt tokens, 10 shared prefixes of 512 tokens) with
``--output-tokens`` per turn. Prints per run guidellm's TTFT (mean, median, p95), its
completed requests, and the share of prompt tokens the replicas read from their cache
(the gateway's ``/metrics``: cached tokens the replicas reported over the tenants' input
tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from prefixgate.models import ensure_tokenizer_dir
from prefixgate.procs import free_port, wait_http_ok


def metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_up(
    args: argparse.Namespace, policy: str, run_dir: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate", "up", "--model", "sim", "--replicas"]
    cmd += [str(args.replicas), "--port", str(port), "--policy", policy, "--run-dir", str(run_dir)]
    log = open(run_dir.with_suffix(".log"), "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/ready?min_replicas={args.replicas}", 120, [proc])
    return proc, url


def run_guidellm(args: argparse.Namespace, url: str, out: Path) -> dict[str, float]:
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens},turns={args.turns},"
        f"prefix_tokens={args.prefix_tokens},prefix_count={args.prefix_count}"
    )
    cmd = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model=sim,request_format=/v1/chat/completions",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--data", data,
        "--tokenizer", f"kind=hf_auto,model={ensure_tokenizer_dir('sim')}",
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--seed", f"kind=static,value={args.seed}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=args.seconds + 600)
    bench = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ttft = bench["time_to_first_token_ms"]["successful"]
    return {
        "ttft_mean_ms": ttft["mean"],
        "ttft_p50_ms": ttft["percentiles"]["p50"],
        "ttft_p95_ms": ttft["percentiles"]["p95"],
        "completed": bench["request_totals"]["successful"],
        "errored": bench["request_totals"]["errored"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guidellm", required=True, help="the guidellm command (its own venv)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin", "least_loaded"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seconds", type=int, default=90)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--prefix-count", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="guidellm-live-"))
    for repeat in range(args.repeats):
        for policy in args.policies:
            run_dir = work / f"{policy}-{repeat}"
            proc, url = start_up(args, policy, run_dir)
            try:
                cpu_before = os.times()
                result = run_guidellm(args, url, work / f"{policy}-{repeat}.json")
                metrics = httpx.get(url + "/metrics", timeout=10).text
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            cached = metric_sum(metrics, "prefixgate_gateway_reported_cached_tokens_total")
            prompt = metric_sum(metrics, "prefixgate_gateway_tenant_tokens_total", 'kind="input"')
            children = os.times()
            cpu = (children.children_user + children.children_system) - (
                cpu_before.children_user + cpu_before.children_system
            )
            print(
                f"repeat {repeat} {policy:13s} TTFT mean {result['ttft_mean_ms']:.0f} ms, "
                f"p50 {result['ttft_p50_ms']:.0f} ms, p95 {result['ttft_p95_ms']:.0f} ms; "
                f"{result['completed']:.0f} requests ({result['errored']:.0f} errors); "
                f"cached {cached / max(prompt, 1):.3f} of {prompt:.0f} prompt tokens; "
                f"CPU of the cluster (with its start) and guidellm {cpu:.0f} s",
                flush=True,
            )
    print(f"records in {work}")


if __name__ == "__main__":
    main()
