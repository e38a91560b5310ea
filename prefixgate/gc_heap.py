"""The garbage collector's settings for a server (gateway, replica), set once it serves.

CPython collects its youngest generation each time 700 more container objects (dicts,
lists, ...) are alive than at the last collection, promotes what survives, and walks the
whole heap when enough has been promoted. An agent's turn allocates more than 700, many
alive until its answer comes (its parsed body alone is 365 dicts and lists with 30 tool
definitions; then its validated request and the template's render): about one young
collection per request, whose survivors, the requests in flight, were promoted, and
full collections that walked the start-up heap too (about 100,000 objects: tokenizers,
templates, modules; a replica's model besides), alive until exit. Measured
on agent turns (``benchmarks/gateway_workers.py --gc-probe``,
``benchmarks/replica_gc.py``): about a fifth of the gateway's and of a simulated
replica's CPU in the collector, and pauses of 50-190 ms for every request in flight.

``settle``, once the server is up:

* freezes the start-up heap: collections skip it from then on (vLLM's API server does
  the same, ``freeze_gc_heap``);
* collects the youngest generation after ``GEN0_THRESHOLD`` more live containers
  instead of 700: a burst of request bodies is no longer a collection.

Garbage in reference cycles waits longer for a collection so, as it holds what it
references (a body, an answer), requests make none: every way a request goes frees
what it made by reference counting (tests/gateway/test_reference_cycles.py,
tests/replica/test_reference_cycles.py).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def settle(gen0_threshold: int = GEN0_THRESHOLD) -> int:
    """Collect, freeze what is left, raise the youngest generation's threshold (the
    older ones' stay). Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    return gc.get_freeze_count()
