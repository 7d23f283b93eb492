"""Candidates measured in a GPU lane's own process (the CUDA context and the MPS share are the lane's), one
at a time, guarded: each candidate's crash count is raised before it runs, a suspect of an earlier fault
runs alone on its GPU (services.measurer.isolation), a watchdog catches a kernel that never returns, and
what a CUDA fault means is isolation.judge's call; a fault is reported for the node agent to recover the
GPU, and ends the lane."""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext

from shared import lanes, names, store, timeouts
from shared.messages import ErrorKind, GpuFault, MeasureBatch, MeasureResult, Quarantined
from services.measurer import poison

log = logging.getLogger("sharetune.lane")


def cuda_alive() -> bool:
    from services.measurer.metaschedule.timing import cuda_context_alive

    return cuda_context_alive()


class InProcessMeasuring:
    """The guarded in-process measuring of one lane (`owner`: its services.measurer.worker.LaneWorker, which
    owns the Redis connection, the lane, its settings and build pool). `gpu_fault`: set when the lane's CUDA
    context died (it measures no more); `held`: (batch, answers) held for the NVML window, written by the
    watchdog if the lane dies holding them."""

    def __init__(self, owner):
        self.owner = owner
        self.fault_domain = owner.fault_domain  # the GPU whose fault would end this lane, if any
        self.gpu_fault: str | None = None
        self.held: tuple[str, list[MeasureResult]] | None = None
        self._watchdog = None

    @property
    def watchdog_margin_s(self) -> float:
        """Past its build wait and its run timeout plus this, a candidate's kernel is taken as hung."""
        return self.owner.settings.watchdog_margin_s

    @property
    def pooled(self) -> bool:
        return self.owner.pool is not None

    def measure(self, batch: MeasureBatch, results, quarantined: dict, guard):
        """The batch's `results` (one per candidate not `quarantined`, produced as asked), each run guarded as
        the module says. A CUDA fault ends the batch: the lane's context is gone."""
        from services.measurer.isolation import GpuGate, judge, runs_alone
        from services.measurer.gpu.faults import classify_cuda_error

        r, gpu_lane = self.owner.redis, self.fault_domain is not None
        gate = None
        if gpu_lane:
            gate = GpuGate(r, self.fault_domain, self.owner.worker,
                           hold_s=timeouts.gate_hold_s(batch.timing.timeout_s, self.pooled, self.watchdog_margin_s))
        for cand in batch.candidates:
            if cand.candidate_id in quarantined:  # answered without building or running it
                yield poison.quarantined_result(quarantined[cand.candidate_id], cand.candidate_id)
                continue
            chash = store.candidate_hash(cand.mod)
            alone = gate is not None and runs_alone(store.crash_count(r, chash) + 1)
            with gate.alone() if alone else gate.ordinary() if gate is not None else nullcontext():
                if alone and not cuda_alive():
                    # a neighbour faulted while this suspect waited for the gate, and its context went with the
                    # neighbour's: run now, it would fault alone and be blamed (on the H200, an innocent was)
                    self.report_gpu_fault(chash, "the lane's CUDA context was lost before this suspect ran "
                                           "alone (a neighbour's fault): not run, its count kept", "victim")
                    return
                # raised once it has the GPU, not while it waits: a lane ended in the wait blames no one
                crashes = store.crash_pending(r, chash)
                if alone:
                    store.count_suspect_run(r, self.fault_domain, chash)
                if gpu_lane:
                    self.watchdog().arm(timeouts.watchdog_allowance_s(batch.timing.timeout_s, self.pooled),
                                        batch_id=batch.batch_id, candidate_id=cand.candidate_id, chash=chash,
                                        crashes=crashes, job_id=batch.job_id, timeout_s=batch.timing.timeout_s)
                try:
                    res = next(results)
                finally:
                    if gpu_lane:
                        self.watchdog().disarm()
            role = classify_cuda_error(res.error, res.error_kind) if gpu_lane and res.error else None
            if role is None and gpu_lane and res.error_kind == ErrorKind.RUN and not cuda_alive():
                role = "unknown"
            verdict = judge(role, alone, self.gpu_shared() if role is not None else False, crashes,
                            guard["max_crashes"])
            if verdict.clear:
                store.crash_clear(r, chash)
            if verdict.role is not None:
                self.report_gpu_fault(chash, res.error, verdict.role)
            if verdict.quarantine:
                store.quarantine(r, Quarantined(candidate_hash=chash, error=res.error, crashes=crashes,
                                                lane=self.owner.lane.queue, job_id=guard["job_id"],
                                                batch_id=guard["batch_id"]))
                res.error, res.error_kind = f"quarantined after {crashes} crashes: {res.error}", ErrorKind.CRASH
            if verdict.role is not None:
                res.fault = "crash"
            if verdict.answer:
                yield res
            if verdict.lane_ends:
                # a suspect keeps its count: re-sent to a restarted lane it runs alone, where a culprit faults
                # again and is named and an innocent clears its count; the rest of the batch is re-sent too
                return

    def gpu_shared(self) -> bool:
        """May another lane worker use this lane's GPU (so a fault here may be a neighbour's)? Always below
        100 %: neighbours that saw the same fault first may already have left the lane list."""
        if self.owner.lane.share < 100:
            return True
        me = self.owner.worker
        try:
            return any(l.worker != me and lanes.fault_domain(l.queue) == self.fault_domain
                       for l in store.live_lanes(self.owner.redis))
        except Exception:  # noqa: BLE001 - Redis unreachable: assume neighbours, so no innocent is blamed
            return True

    def report_gpu_fault(self, chash: str, error: str, role: str) -> None:
        lane, info = self.owner.lane, self.owner.info
        self.gpu_fault = f"{role}: {error[:300]}"
        log.error("lane %s lost its CUDA context (%s) on candidate %s: %s", lane.queue, role, chash, error[:300])
        store.report_gpu_fault(self.owner.redis, GpuFault(gpu8=lane.gpu or "", lane=lane.queue,
                                                          worker=info.worker if info else "",
                                                          candidate_hash=chash, error=error[:2000], role=role))

    def watchdog(self):
        if self._watchdog is None:
            from services.measurer.gpu.faults import Watchdog

            self._watchdog = Watchdog(self.on_hung_candidate, margin_s=self.watchdog_margin_s)
        return self._watchdog

    def on_hung_candidate(self, armed: dict) -> None:
        """From the watchdog thread: the lane's own thread is stuck in a kernel that does not return, and a
        context with a spinning kernel cannot be saved. Report the candidate as the GPU's culprit (its raised
        crash count stays; at the cap it is quarantined), answer it, leave the lane list, and exit with the
        GPU-fault code so the supervisor recovers the GPU as after any fault."""
        code = names.EXIT_GPU_FAULT
        try:
            allowance = armed["allowance_s"] + self.watchdog_margin_s
            error = (f"run hung: the candidate's kernel did not return within {allowance:.0f} s (timeout "
                     f"{armed['timeout_s']:.0f} s, build wait and margin included); the lane exits")
            r, queue, held = self.owner.redis, self.owner.lane.queue, self.held
            if held is not None:  # answered before the hang, held for the window's facts: not measured again
                for done in list(held[1]):
                    store.put_result(r, held[0], done)
            self.report_gpu_fault(armed["chash"], error, "culprit")
            res = MeasureResult(candidate_id=armed["candidate_id"], error=error, error_kind=ErrorKind.CRASH,
                                fault="crash", lane=queue)
            if armed["crashes"] >= self.owner.settings.max_crashes:
                store.quarantine(r, Quarantined(candidate_hash=armed["chash"], error=error, crashes=armed["crashes"],
                                                lane=queue, job_id=armed["job_id"], batch_id=armed["batch_id"]))
                res.error = f"quarantined after {armed['crashes']} crashes: {error}"
            store.put_result(r, armed["batch_id"], res)
            self.owner.leave()
        except BaseException:  # noqa: BLE001 - exit regardless: a lane stuck in a kernel serves nobody
            log.exception("reporting a hung candidate failed")
        finally:
            logging.shutdown()
            os._exit(code)
