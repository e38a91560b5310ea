"""Mini grid: worst per workload over N, rates, seeds for given router options."""
import sys, time
from loadtest import skewed_docs
from loadtest.simulate import run_comparison
from loadtest.workloads import default_rate, generate
from router.config import RouterConfig, with_options

KINDS = "shared_system_prompt multi_turn_chat agents doc_qa generated_shared_prefix docs_short_hot docs_long_hot docs_mixed_hot docs_mixed_flat".split()
args = sys.argv[1:]
ns = [4, 16]; seeds = [0]; scales = [1.0, 4.0]
opts = []
for a in args:
    if a.startswith("N="): ns = [int(x) for x in a[2:].split(",")]
    elif a.startswith("S="): seeds = [int(x) for x in a[2:].split(",")]
    elif a.startswith("K="): KINDS = a[2:].split(",")
    else: opts.append(a)
config = with_options(RouterConfig(), opts)
t0 = time.time()
W = [9, 0, 0, 0]; 
for kind in KINDS:
    for scale in scales:
        wh, wt, wb, wb8 = 9.0, 0.0, 0.0, 0.0
        for n in ns:
            for seed in seeds:
                docs = kind in skewed_docs.VARIANTS
                s = skewed_docs.variant(kind, seed=seed, rate_scale=scale) if docs else generate(kind, seed=seed, rate=default_rate(kind) * scale)
                o, r = run_comparison(s, ["cache_aware"], n_replicas=n, seed=seed, config=config, conversation_keys=not docs)
                h, t, b = r.hit_rate / o.hit_rate, r.total_time_s / o.total_time_s, r.busy_imbalance
                wh, wt, wb = min(wh, h), max(wt, t), max(wb, b)
                if n <= 8: wb8 = max(wb8, b)
        flag = ("H" if wh < 0.95 else " ") + ("T" if wt > 1.10 else " ")
        print(f"{kind:24} x{scale:g} hit {wh:.3f} time {wt:.3f} busy {wb:.2f} ({wb8:.2f}) {flag}", flush=True)
        W = [min(W[0], wh), max(W[1], wt), max(W[2], wb), max(W[3], wb8)]
print(f"ALL {' '.join(opts)}: hit {W[0]:.3f} time {W[1]:.3f} busy {W[2]:.2f} ({W[3]:.2f})  {time.time()-t0:.0f}s")
