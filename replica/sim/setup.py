"""``prefixgate replica --model sim``: the simulated engine's flags and construction.

``--sim-profile NAME`` (or a profile ``.json``) picks the GPU cost model; each cost
constant has its own flag (``--sim-weights-s`` …, env ``PREFIXGATE_SIM_WEIGHTS_S`` …) that
overrides the profile's value (``--sim-host-copy-s-per-gb`` is 1 / the host↔device
bandwidth in GB/s; ``--sim-demote-charge`` the fraction of a demotion a step pays). The
KV pool is the profile's real one unless ``--kv-cache-mb`` or ``--num-blocks`` says
otherwise, and ``--host-cache-mb`` adds a host tier, as for the built-in engine.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, NamedTuple

from prefixgate.envflags import add_env_flag
from prefixgate.models import SIM_MODEL
from replica.sim.profile import MIB, OVERRIDE_FIELDS, SimProfile
from replica.sim.profiles import DEFAULT_PROFILE, PROFILE_NAMES, load_profile, summary

if TYPE_CHECKING:
    from replica.sim.backend import SimBackend, SimModel

log = logging.getLogger("prefixgate.replica")


def add_sim_flags(parser: argparse.ArgumentParser) -> None:
    add_env_flag(
        parser,
        "sim-profile",
        default=DEFAULT_PROFILE,
        help=f"with --model sim: GPU cost profile, {' or '.join(PROFILE_NAMES)}, or a "
        "profile .json (benchmarks/measure_sim_profile.py)",
    )
    for name in OVERRIDE_FIELDS:
        add_env_flag(
            parser,
            "sim-" + name.replace("_", "-"),
            type=float,
            help=f"with --model sim: override the profile's {name} (replica/sim/profile.py)",
        )


def sim_profile(args: argparse.Namespace) -> SimProfile:
    """The profile the flags name, with their overrides (ValueError if bad)."""
    profile = load_profile(args.sim_profile)
    overrides = {name: getattr(args, "sim_" + name) for name in OVERRIDE_FIELDS}
    return profile.with_overrides(**overrides)


class SimReplica(NamedTuple):
    model: SimModel
    backend: SimBackend


def build_sim(args: argparse.Namespace, served_name: str) -> SimReplica:
    """The model (SmolLM2's tokenizer under ``served_name``) and the sleeping backend."""
    from prefixgate.tokenizer import ChatTokenizer
    from replica.sim.backend import SimModel, sim_backend

    profile = sim_profile(args)
    tokenizer = ChatTokenizer.for_model(SIM_MODEL)
    tokenizer.name = served_name
    backend = sim_backend(
        profile,
        tokenizer,
        args.block_size,
        kv_cache_mb=args.kv_cache_mb,
        num_blocks=args.num_blocks,
        host_cache_mb=args.host_cache_mb,
    )
    log.info("simulated engine: %s", summary(profile, args.block_size))
    if backend.host_pool is not None:
        log.info(
            "simulated host tier: %d blocks (%.0f MiB)",
            backend.host_pool.num_blocks,
            backend.host_pool.nbytes / MIB,
        )
    return SimReplica(SimModel(served_name, tokenizer, profile.max_context), backend)
