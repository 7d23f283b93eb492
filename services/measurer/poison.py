"""Poison candidates: a candidate whose build or run kills (or hangs) its process is retried at most
`max_crashes` times in all, then quarantined with its error and answered without running.

The count lives in Redis and is raised *before* the candidate runs and cleared when it comes back with
an answer, so a process that dies with the candidate (a sandbox child, or a whole lane: SIGKILL, a CUDA
fault under MPS) leaves the count behind for whichever lane sees the candidate next."""
from __future__ import annotations

from collections.abc import Callable

from shared import store
from shared.messages import Candidate, ErrorKind, MeasureResult, Quarantined


def quarantined_result(entry: Quarantined, candidate_id: str) -> MeasureResult:
    return MeasureResult(candidate_id=candidate_id, fault="quarantined", error_kind=ErrorKind.CRASH,
                         error=f"quarantined after {entry.crashes} crashes: {entry.error}")


def already_poison(r, chash: str, *, max_crashes: int, lane: str, job_id: str = "", batch_id: str = "") -> Quarantined | None:
    """Before a candidate runs: its quarantine entry, or a new one when processes already died with it
    max_crashes times (lanes that died with it in flight left their counts)."""
    entry = store.quarantined(r, chash)
    if entry is None and (crashes := store.crash_count(r, chash)) >= max_crashes:
        entry = Quarantined(candidate_hash=chash, crashes=crashes, lane=lane, job_id=job_id, batch_id=batch_id,
                            error=f"its process died {crashes} times while running it")
        store.quarantine(r, entry)
    return entry


def measure_guarded(r, cand: Candidate, run: Callable[[Candidate], MeasureResult], *, max_crashes: int,
                    lane: str, job_id: str = "", batch_id: str = "") -> MeasureResult:
    """Run one candidate through `run` (which reports a lost process as `fault`), keeping its crash
    count; a crash is retried in a fresh process until the count reaches `max_crashes`. A hang is not
    retried in the same batch (it would cost another full timeout) but counts the same."""
    chash = store.candidate_hash(cand.mod)
    entry = already_poison(r, chash, max_crashes=max_crashes, lane=lane, job_id=job_id, batch_id=batch_id)
    if entry is not None:
        return quarantined_result(entry, cand.candidate_id)
    while True:
        crashes = store.crash_pending(r, chash)
        res = run(cand)
        if res.fault is None:
            store.crash_clear(r, chash)
            return res
        if crashes >= max_crashes:
            entry = Quarantined(candidate_hash=chash, error=res.error or res.fault, crashes=crashes, lane=lane,
                                job_id=job_id, batch_id=batch_id)
            store.quarantine(r, entry)
            res.error = f"quarantined after {crashes} crashes: {res.error}"
            return res
        if res.fault == "timeout":
            return res
