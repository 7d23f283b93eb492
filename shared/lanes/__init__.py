"""Lanes: what a lane is (base.LaneKind, one implementation per kind: cpu, gpu), and which live lanes
serve a job (live). Every question that depends on a lane's kind is asked here."""
from __future__ import annotations

import json

from shared.lanes import cpu, gpu  # noqa: F401 - each registers its kind
from shared.lanes.base import Host, Lane, LaneKind, kind, kinds, register
from shared.lanes.live import LiveLanePolicy, serving, shares_served, waiting_for

__all__ = ["Host", "Lane", "LaneKind", "LiveLanePolicy", "fault_domain", "for_target", "kind", "kind_of", "kinds", "of",
           "parse", "register", "serving", "shares_served", "target_family", "target_kinds", "waiting_for"]

# a host that places any short CPU form, for the questions whose answer no host changes (kind, fault domain)
_ANY_HOST = Host(cores=1 << 16)


def parse(queue: str, host: Host | None = None) -> Lane:
    """The lane a queue name names; ValueError when no kind knows the name, or when it names a place on a host
    (a CPU lane's cores alone: measure.cpu.c0) and `host` is not given."""
    for k in kinds():
        lane = k.parse(queue, host)
        if lane is not None:
            return lane
    raise ValueError(f"not a lane queue name: {queue!r}")


def of(lane: Lane) -> LaneKind:
    """The kind of a lane."""
    return kind(lane.kind)


def kind_of(queue: str) -> LaneKind:
    """The kind of the lane a queue names (ValueError when it names none)."""
    return of(parse(queue, _ANY_HOST))


def fault_domain(queue: str) -> str | None:
    """The device whose fault ends every lane on it, for a lane's queue (its GPU); None for a lane that
    faults alone, or a name that is no lane's."""
    try:
        lane = parse(queue, _ANY_HOST)
    except ValueError:
        return None
    return of(lane).fault_domain(lane)


def target_kinds() -> tuple[str, ...]:
    return tuple(k.target_kind for k in kinds())


def for_target(target: str | dict) -> LaneKind:
    """The kind of lane that measures for a target (a name such as "llvm", a dict, or a target's JSON)."""
    from shared.messages import target_kind

    name = target_kind(target)
    return next(k for k in kinds() if k.target_kind == name)


def target_family(target: str | dict) -> str:
    """The build family of a target (its JSON text or dict): cuda.sm_90, llvm.skylake-avx512."""
    t = json.loads(target) if isinstance(target, str) else dict(target)
    for k in kinds():
        if k.target_kind == t.get("kind"):
            return k.family(t)
    raise ValueError(f"no build family for target kind {t.get('kind')!r}")
