"""The plan of which GPU lanes (GPU, percent) a host runs, from a share spec and the GPU inventory."""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from shared.errors import ShareError
from shared.ids import gpu_hex as _hex
from shared import lanes
from shared.lanes import Lane
from services.measurer.observers.inventory import GpuInfo

_ITEM = re.compile(r"^(?:(?P<count>\d+)\s*[x×*]\s*)?(?P<pct>-?\d+)\s*%?$", re.IGNORECASE)


def parse_share_spec(spec: str | int | Sequence[int]) -> list[int]:
    """"4x25" -> [25, 25, 25, 25]; "25,25,50" -> [25, 25, 50]; "2x25,50" -> [25, 25, 50]; 100 -> [100].
    Only the syntax is checked here; ranges are checked per GPU by ``plan_gpu_lanes``."""
    if isinstance(spec, bool):
        raise ShareError(f"not a GPU share spec: {spec!r}")
    if isinstance(spec, int):
        return [spec]
    if not isinstance(spec, str):
        try:
            return [int(p) for p in spec]
        except (TypeError, ValueError):
            raise ShareError(f"not a GPU share spec: {spec!r}") from None
    percents: list[int] = []
    for item in spec.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise ShareError(f"not a GPU share spec: {spec!r} (expected e.g. '4x25', '1x100' or '25,25,50')")
        count = int(m["count"]) if m["count"] is not None else 1
        if count < 1:
            raise ShareError(f"GPU share spec {spec!r} asks for {count} lanes of {m['pct']} %")
        percents += [int(m["pct"])] * count
    return percents


def find_gpu(gpus: Sequence[GpuInfo], key: int | str) -> GpuInfo:
    """A GPU by index (an int, or a string of digits naming an index) or else by UUID prefix ("GPU-3f2a",
    "3f2a1c9b"). A prefix matching several GPUs is refused as ambiguous."""
    have = ", ".join(f"{g.index}: {g.uuid}" for g in gpus) or "none"
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ShareError(f"not a GPU index or UUID prefix: {key!r}")
    if isinstance(key, int):
        found = [g for g in gpus if g.index == key]
    else:
        text = key.strip().lower()
        hexkey = _hex(text)
        if not hexkey:
            raise ShareError(f"not a GPU index or UUID prefix: {key!r}")
        found = [g for g in gpus if g.index == int(text)] if text.isdigit() else []
        if not found:
            found = [g for g in gpus if _hex(g.uuid).startswith(hexkey)]
    if not found:
        raise ShareError(f"GPU {key!r} is not in this host's inventory (GPUs: {have})")
    if len(found) > 1:
        raise ShareError(f"GPU {key!r} is ambiguous: it names {', '.join(g.label for g in found)}")
    return found[0]


def gpu_for_lane(gpus: Sequence[GpuInfo], lane: Lane) -> GpuInfo:
    """The inventory GPU a GPU lane runs on (the lane carries only the UUID's first 8 hex digits)."""
    return find_gpu(gpus, lane.gpu)


def plan_gpu_lanes(
    gpus: Sequence[GpuInfo], spec: str | dict, max_total_percent: int = 100
) -> list[tuple[Lane, int]]:
    """The GPU lanes this host runs, as (lane, number of worker processes) pairs, by GPU index.

    ``spec`` is one share spec for every GPU ("4x25", "2x50", "1x100", "25,25,50") or a dict
    {GPU index or UUID prefix: share spec} naming some GPUs (the others get no lane). Lanes with the same
    (GPU, percent) share one queue name, so they appear once with their count: "4x25" on one GPU is
    [(measure.<uuid8>.p25, 4)] -- four Celery worker processes serving that one queue.

    Refused (ShareError): a percent outside 1..100; shares on one GPU summing past
    ``max_total_percent``; a GPU the inventory lacks (or named twice); an empty plan.
    """
    if isinstance(max_total_percent, bool) or not isinstance(max_total_percent, int) or max_total_percent < 1:
        raise ShareError(f"max_total_percent must be a positive whole percent, not {max_total_percent!r}")
    seen8: dict[str, GpuInfo] = {}
    for g in gpus:
        if g.uuid8 in seen8:
            raise ShareError(
                f"{g.label} and {seen8[g.uuid8].label} share the UUID prefix {g.uuid8}: their lane queues would collide"
            )
        seen8[g.uuid8] = g

    if isinstance(spec, Mapping):
        per_gpu: dict[int, tuple[GpuInfo, list[int]]] = {}
        for key, sub in spec.items():
            gpu = find_gpu(gpus, key)
            if gpu.index in per_gpu:
                raise ShareError(f"{gpu.label} is named twice in the lane plan")
            per_gpu[gpu.index] = (gpu, parse_share_spec(sub))
        assignments = [per_gpu[i] for i in sorted(per_gpu)]
    else:
        percents = parse_share_spec(spec)
        assignments = [(g, percents) for g in sorted(gpus, key=lambda g: g.index)]

    plan: list[tuple[Lane, int]] = []
    for gpu, percents in assignments:
        for p in percents:
            if not 1 <= p <= 100:
                raise ShareError(f"{gpu.label}: share {p} % is outside 1..100 %")
        total = sum(percents)
        if total > max_total_percent:
            raise ShareError(
                f"{gpu.label}: shares {' + '.join(map(str, percents))} = {total} % exceed the limit of "
                f"{max_total_percent} %"
            )
        counts: dict[int, int] = {}
        for p in percents:
            counts[p] = counts.get(p, 0) + 1
        plan += [(lanes.kind("gpu").lane(gpu.uuid, p), n) for p, n in counts.items()]
    if not plan:
        where = "the inventory has no GPU" if not gpus else f"spec {spec!r} names no lane"
        raise ShareError(f"empty GPU lane plan: {where}")
    return plan
