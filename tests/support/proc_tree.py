"""A process's children and liveness, read from /proc (Linux): for the tests of processes
that start others (a gateway's workers)."""

from __future__ import annotations

import os


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``, sorted."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it holds no port or memory)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"
