"""The ``--api-keys`` file, read again when it changes: a key revoked, added or given new
limits takes effect at every gateway within seconds, without a restart (LiteLLM's keys
live in its database and change at once; a leaked key must not wait for a rollout).

A change is a new (inode, size, mtime) of the file the path names, symlinks followed
(Kubernetes swaps a mounted Secret by renaming a link). It is applied once the file has
stayed the same for a whole ``REFRESH_S`` period, so a file caught half-written (an
editor saving in place) is not read as a shorter list of keys. A file that no longer
parses keeps the keys in use, and says why once per change. The gateway checks it every
``REFRESH_S`` (gateway/app.py ``watch_keys``) and swaps its authenticator and the tenants'
caps and rates at once, between two requests; requests already admitted finish under the
keys they were admitted with.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gateway.auth import Authenticator, load_api_keys

log = logging.getLogger("prefixgate.gateway")

REFRESH_S = 2.0

Stamp = tuple[int, int, int] | None


def stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class KeysFile:
    """Watches one keys file; ``check`` says when a settled change should be applied."""

    __slots__ = ("_applied", "_pending", "path")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._applied = stamp(path)  # what the keys in use were read from
        self._pending = self._applied  # what the last check saw

    def check(self) -> Authenticator | None:
        """A new authenticator when the file changed and has stayed so since the last
        check, and parses; None otherwise (nothing to apply)."""
        now = stamp(self.path)
        settled = now == self._pending
        self._pending = now
        if not settled or now == self._applied:
            return None
        self._applied = now  # tried once per change, whether it parses or not
        try:
            return Authenticator(load_api_keys(self.path))
        except Exception as exc:  # OSError, a YAML or JSON error, a ValueError
            log.warning(
                "API keys file %s changed but does not load (%s): kept the old keys",
                self.path,
                exc,
            )
            return None
