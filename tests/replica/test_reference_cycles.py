"""Finished requests leave no reference cycles in the engine.

A request's sequences point back at it (``SequenceState.request``), so every finished
request, with its handle, its deltas and its output, was garbage only the collector
could free. With the collector made rare once a server is up (prefixgate/gc_heap.py),
that garbage waited, and each collection walked it. The engine drops the sequences
when the request is closed; every way a request ends is run here with the collector
off, then one collection with ``DEBUG_SAVEALL`` must find nothing of the engine's.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from replica.engine import Engine
from replica.models import LoadedModel, load_model
from replica.request import SamplingParams
from tests.replica.test_engine import _prompt, running


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", dtype="float32")


def every_ending(engine: Engine) -> None:
    """A request ending by length, by a stop string, with three choices, and cancelled
    while decoding."""
    prompt = _prompt(4, 30)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = engine.generate(prompt, greedy).choices[0]
    assert full.finish_reason == "length"
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    assert engine.generate(prompt, cut).choices[0].finish_reason == "stop"
    three = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True)
    assert len(engine.generate(prompt, three).choices) == 3
    long = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
    handle = engine.submit(_prompt(6, 50), long)
    stream = iter(handle)
    next(stream)  # it is decoding
    engine.cancel(handle.request_id)
    assert list(stream)[-1].finish_reason == "abort"


def test_no_way_a_request_ends_leaves_a_reference_cycle(tiny: LoadedModel) -> None:
    with running(tiny, num_blocks=512) as engine:
        every_ending(engine)  # the first requests fill what the engine keeps
        engine.run_until_idle(timeout=60)
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                every_ending(engine)
            engine.run_until_idle(timeout=60)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            found = Counter(
                type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("replica.")
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert not found, found.most_common(12)
