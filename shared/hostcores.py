"""Who times on which core of this host. A lane holds an exclusive lock on a file per core it is pinned to
(flock, in a directory every stack of the host shares), for as long as its process lives: the kernel drops
the lock when the process ends, however it ends, so no stale claim outlives a killed lane. A second stack, a
hand-started lane or a replica whose cores are held is refused (or, with the "warn" policy, told), never
overlapped in silence: two timers on one core make both sets of figures noise.

The lock directory is per host (default /tmp/sharetune-cores; SHARETUNE_CORE_LOCK_DIR): containers see each
other's claims only when they mount the same directory."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path

from shared.errors import LaneError

DEFAULT_LOCK_DIR = "/tmp/sharetune-cores"
POLICIES = ("refuse", "warn")


class CoresTaken(LaneError):
    """Cores another live process already times on."""


def _path(lock_dir: str | Path, core: int) -> Path:
    return Path(lock_dir) / f"core-{int(core)}.lock"


def describe_holders(holders: dict[int, str]) -> str:
    """'cores 0,1 held by lane ... (pid N on host)' for each holder."""
    by_holder: dict[str, list[int]] = {}
    for core, who in sorted(holders.items()):
        by_holder.setdefault(who or "a process that did not say", []).append(core)
    return "; ".join(f"core{'s' if len(c) > 1 else ''} {','.join(map(str, c))} held by {who}"
                     for who, c in by_holder.items())


class CoreClaim:
    """The cores this process holds (open locked files); `overlaps`: cores it shares with another holder
    (the "warn" policy only). Released when closed or when the process ends."""

    def __init__(self, files: dict, overlaps: dict[int, str]):
        self._files, self.overlaps = files, overlaps

    @property
    def cores(self) -> list[int]:
        return sorted(self._files)

    def release(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


def holders(cores: Iterable[int], lock_dir: str | Path = DEFAULT_LOCK_DIR) -> dict[int, str]:
    """Core -> its holder's description, for the cores another open file holds now."""
    held = {}
    for core in sorted(set(cores)):
        path = _path(lock_dir, core)
        if not path.exists():
            continue
        with open(path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                held[core] = f.read().strip()
            else:
                fcntl.flock(f, fcntl.LOCK_UN)
    return held


def claim(cores: Iterable[int], holder: str, lock_dir: str | Path = DEFAULT_LOCK_DIR,
          policy: str = "refuse") -> CoreClaim:
    """Lock each core for `holder` (who is timing there: the lane's queue, pid, stack). Cores held by another
    process: CoresTaken naming them and their holders ("refuse"), or a claim of the free ones whose
    `overlaps` says what is shared ("warn")."""
    if policy not in POLICIES:
        raise LaneError(f"core overlap policy {policy!r}: use one of {', '.join(POLICIES)}")
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    files, taken = {}, {}
    for core in sorted(set(cores)):
        f = open(_path(lock_dir, core), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            taken[core] = f.read().strip()
            f.close()
            continue
        f.seek(0)
        f.truncate()
        f.write(holder)
        f.flush()
        files[core] = f
    if taken and policy == "refuse":
        for f in files.values():
            f.close()
        raise CoresTaken(f"{holder}: {describe_holders(taken)}. Two timers on one core make both measure noise: stop "
                         "the other, pick other cores, or set SHARETUNE_CORE_OVERLAP=warn to run anyway")
    return CoreClaim(files, taken)


def check_free(lanes: Iterable[tuple[str, Iterable[int]]], lock_dir: str | Path = DEFAULT_LOCK_DIR,
               policy: str = "refuse") -> None:
    """Before a group of lanes starts (a stack): CoresTaken when two of them would time on one core or another
    live process holds one of their cores, unless the policy is "warn" (each lane then says so as it claims)."""
    if policy != "refuse":
        return
    wanted: dict[int, str] = {}
    for name, cores in lanes:
        for core in cores:
            if core in wanted:
                raise CoresTaken(f"lanes {wanted[core]} and {name} of this stack both time on core {core}")
            wanted[core] = name
    held = holders(wanted, lock_dir)
    if held:
        raise CoresTaken(f"this stack's lanes would time on cores another process holds: {describe_holders(held)}. "
                         "Stop it (`sharetune down` in its work dir), give other --lanes, or set "
                         "SHARETUNE_CORE_OVERLAP=warn")


def this_process(what: str) -> str:
    """A holder's description: what it is, its pid and host."""
    import socket

    return f"{what} (pid {os.getpid()} on {socket.gethostname()})"
