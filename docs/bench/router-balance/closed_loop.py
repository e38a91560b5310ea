"""The issue's case: closed loop, 16 clients, no think time, N=4, 3 seeds, worst."""
import sys
from loadtest import skewed_docs
from loadtest.simulate import run_comparison
from loadtest.workloads import default_rate, generate
from router.config import RouterConfig, with_options
config = with_options(RouterConfig(), sys.argv[1:])
for kind in ["docs_long_hot", "docs_mixed_flat", "docs_mixed_hot", "docs_short_hot", "agents", "multi_turn_chat"]:
    wh, wt, wb = 9.0, 0.0, 0.0
    for seed in (0, 1, 2):
        docs = kind in skewed_docs.VARIANTS
        s = skewed_docs.variant(kind, seed=seed) if docs else generate(kind, seed=seed, rate=default_rate(kind))
        o, r = run_comparison(s, ["cache_aware"], n_replicas=4, seed=seed, config=config, concurrency=16, think_s=0, conversation_keys=not docs)
        wh, wt, wb = min(wh, r.hit_rate / o.hit_rate), max(wt, r.total_time_s / o.total_time_s), max(wb, r.busy_imbalance)
    print(f"{kind:18} hit {wh:.3f} time {wt:.3f} busy {wb:.2f}", flush=True)
