"""Engine KV media → prefixgate tiers.

Engines tag every ``BlockStored`` / ``BlockRemoved`` with the ``medium`` the block is in;
prefixgate's events carry one of two tiers (router/protocol.py ``Medium``): ``device``
(a hit is free) and ``host`` (a hit is a copy back, priced by the router as such).
Names are matched case-insensitively:

    medium                 tier     who sends it
    (none)                 device   engines from before media
    GPU                    device   vLLM's block pool, SGLang's radix cache
    CPU                    host     vLLM's offloading connectors (mooncake: "cpu")
    CPU_PINNED, CPU_TIER1  host     SGLang HiCache's host memory (L2; 0.5.23's name, an
                                    earlier one)
    STORAGE, CPU_TIER2     ignored  disk, object stores, remote pools (L3)
    DISK, EXTERNAL         ignored  SGLang 0.5.23's L3 (SSD) and L4 (a shared remote pool)

Storage tiers are not tracked: they may be shared by many engines, hold far more
blocks than the router indexes per replica, and SGLang sends no removals for its L3, so
keys from them would claim hits that are not this replica's or stay forever. A block
only there is priced as uncached, which is what routing without the bridge assumed.

A medium not in the table is ignored as well, with one warning per name: taken as the
device, a new storage tier would become confident, never-expiring hits. An operator
whose engine names its device memory otherwise maps it with ``--medium NAME=device``
(``prefixgate bridge``), which also overrides the table above.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from router.protocol import Medium

log = logging.getLogger("prefixgate.bridge")

TierChoice = Literal["device", "host", "ignore"]
TIER_CHOICES: tuple[TierChoice, ...] = ("device", "host", "ignore")

# Upper-cased engine medium → tier; None: not tracked.
KNOWN_MEDIA: MappingProxyType[str, Medium | None] = MappingProxyType(
    {
        "GPU": "device",
        "CPU": "host",
        "CPU_TIER1": "host",
        "CPU_PINNED": "host",
        "STORAGE": None,
        "CPU_TIER2": None,
        "DISK": None,
        "EXTERNAL": None,
    }
)


def known_media_text() -> str:
    """The built-in table in one line, for ``--medium``'s help: ``GPU device; CPU, ... host;
    STORAGE, ... ignored``."""
    by_tier: dict[str, list[str]] = {}
    for name, tier in KNOWN_MEDIA.items():
        by_tier.setdefault(tier or "ignored", []).append(name)
    return "; ".join(f"{', '.join(names)} {tier}" for tier, names in by_tier.items())


# Distinct unknown names warned about; a hostile engine cannot grow the set beyond this.
MAX_WARNED = 32


def parse_medium_flag(value: str) -> tuple[str, Medium | None]:
    """``NAME=device|host|ignore`` (``--medium``) → (upper-cased name, tier or None)."""
    name, sep, tier = value.partition("=")
    name, tier = name.strip().upper(), tier.strip().lower()
    if not sep or not name or tier not in TIER_CHOICES:
        raise ValueError(f"--medium {value!r}: expected NAME=device, NAME=host or NAME=ignore")
    return name, None if tier == "ignore" else tier  # type: ignore[return-value]


@dataclass(slots=True)
class MediumMap:
    """The table above plus the operator's overrides; warns once per unknown name."""

    overrides: dict[str, Medium | None] = field(default_factory=dict)  # upper-cased names
    warned: set[str] = field(default_factory=set)
    unknown_events: int = 0  # events in a medium neither the table nor an override names

    def tier(self, medium: str | None) -> Medium | None:
        """The tier a block in ``medium`` is in; None: not tracked."""
        if medium is None:
            return "device"
        name = medium.upper()
        if name in self.overrides:
            return self.overrides[name]
        if name in KNOWN_MEDIA:
            return KNOWN_MEDIA[name]
        self.unknown_events += 1
        if name not in self.warned and len(self.warned) < MAX_WARNED:
            self.warned.add(name)
            log.warning(
                "engine reports blocks in medium %r, which prefixgate does not know: their "
                "events are ignored. If it is the engine's device memory, start the bridge "
                "with --medium %s=device (or =host for a host-memory tier)",
                medium[:64],
                name[:64],
            )
        return None
