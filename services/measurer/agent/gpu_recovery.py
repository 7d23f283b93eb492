"""A node's lanes kept running and its GPUs recovered: a lane process that ended is started again (after its
back-off, or given up when it keeps dying), and after a GPU fault every client of that GPU is ended, its MPS
server restarted, its lanes started again and the recovery judged in later rounds; a GPU whose recoveries
keep failing is given up with a clear error in the store. The decisions are services.measurer.gpu's; this
part carries them out on this host's processes, by PID."""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace

from shared import lanes as lane_kinds
from shared import names, store
from services.measurer.agent.processes import NodeConfig, ProcessSupervisor

CLIENT_GRACE_S = 1.0  # SIGTERM to SIGKILL for a faulted GPU's clients


class HostProcesses:
    """The host's process table and a signal sender: what a GPU reset reads and ends (tests give fakes)."""

    def table(self) -> dict:
        from services.measurer.gpu import read_process_table

        return read_process_table()

    def end(self, pids, grace_s: float = 3.0) -> dict:
        from services.measurer.gpu import end_processes

        return end_processes(pids, grace_s)


class GpuRecovery:
    """`lane_procs`: the agent's lane processes (name -> (queue, instance)), started by `start_lane(queue,
    instance)`; `uuids`: this host's GPUs (uuid8 -> full UUID); `mps`: the MPS daemon (when the agent runs
    GPU lanes); `recoveries`: what was done, with times (faults bench, tests); `attempts`: the recoveries in
    doubt (uuid8 -> services.measurer.gpu.GpuAttempt); `failures`: recoveries that failed in a row;
    `given_up`: uuid8 -> why no lane of that GPU is started again."""

    def __init__(self, config: NodeConfig, processes: ProcessSupervisor, lane_procs: dict[str, tuple[str, int]],
                 start_lane: Callable[[str, int], object]):
        self.config, self.processes, self.lane_procs, self.start_lane = config, processes, lane_procs, start_lane
        self.host = HostProcesses()
        self.uuids: dict[str, str] = {}
        self.mps = None  # services.measurer.gpu.MpsDaemon, when this agent runs GPU lanes
        self.recoveries: list[dict] = []
        self.attempts: dict = {}
        self.failures: dict[str, int] = {}
        self.phases: dict[str, dict] = {}  # uuid8 -> the phase times of its recovery in progress
        self.given_up: dict[str, str] = {}

    def start_support(self) -> None:
        """Name GPUs by UUID, and start an MPS daemon (own pipe and log dirs) unless one answers."""
        from services.measurer.gpu import MpsDaemon
        from services.measurer.observers import make_observer
        from shared.ids import gpu8

        self.uuids = {gpu8(g.uuid): g.uuid for g in make_observer().inventory()}
        mps = MpsDaemon(self.config.work_dir / "mps" / "pipe", self.config.work_dir / "mps" / "log")
        mps.start()
        self.mps = mps

    def stop(self) -> None:
        if self.mps is not None:
            self.mps.stop()  # only if this agent started it
            self.mps = None

    def recover_once(self, faults_since: float, now: float | None = None) -> float:
        """One round: find lane processes that ended and GPU faults reported since `faults_since`, judge
        the GPU recoveries still in doubt, act on services.measurer.gpu.plan_recovery's decision; returns
        the new `faults_since`."""
        from services.measurer.gpu import LaneExit, plan_recovery

        now = time.time() if now is None else now
        procs = self.processes.procs
        exits = [LaneExit(name, q, procs[name].returncode, now) for name, (q, _) in list(self.lane_procs.items())
                 if self.processes.exited(name)
                 # a lane that shares a fault domain is restarted by the recovery plan, at once
                 and (lane_kinds.fault_domain(q) or not self.processes.backing_off(name, now))]
        faults = []
        if self.uuids:
            r = store.connect(self.config.redis_url)
            faults = [f for g in self.uuids if g not in self.given_up for f in store.gpu_faults(r, g, since=faults_since)]
        for e in exits:
            self.processes.forget_dead(e.name, procs[e.name].pid)
        plan = plan_recovery(exits, faults, self.processes.restarts, now, gpu_fault_code=names.EXIT_GPU_FAULT)
        retry, give_up = self._judge(now, set(plan.gpus), faults)
        if plan.empty and not (retry or give_up):
            return faults_since
        gpus = sorted((set(plan.gpus) | retry) - give_up - set(self.given_up))
        event = {"detected_at": now, "exits": {e.name: e.code for e in exits}, "gpus": gpus,
                 "restarted": list(plan.restart), "given_up": list(plan.given_up), "gpus_given_up": sorted(give_up),
                 "faults": [f.model_dump() for f in faults]}
        for name in plan.given_up:
            self.processes.give_up(name, event["exits"].get(name), len(self.processes.restarts.get(name, ())))
        for gpu8 in sorted(give_up):
            event.setdefault("gpu_resets", {})[gpu8] = self._give_up_gpu(gpu8, faults)
        for gpu8 in gpus:
            event.setdefault("gpu_lanes", []).extend(self._restart_gpu(gpu8, event))
        for name in plan.restart:
            if name in self.lane_procs:
                self.restart_lane(name, now)
        event["restarted_at"] = time.time()
        self.recoveries.append(event)
        # reports that arrive while a GPU recovers belong to the same incident (lanes stopping)
        return max([faults_since] + [f.at + 1e-6 for f in faults] + ([event["restarted_at"]] if gpus or give_up else []))

    def restart_lane(self, name: str, now: float | None = None) -> None:
        queue, instance = self.lane_procs[name]
        old = self.processes.procs.pop(name, None)
        self.processes.note_restart(name, time.time() if now is None else now)
        new = self.start_lane(queue, instance)
        self.config.log.warning("%s (pid %s) exited with %s: started again as pid %s", name, getattr(old, "pid", None),
                                getattr(old, "returncode", None), getattr(new, "pid", None))

    def lane_names(self, gpu8: str) -> list[str]:
        return [n for n, (q, _) in self.lane_procs.items() if lane_kinds.fault_domain(q) == gpu8]

    def _restart_gpu(self, gpu8: str, event: dict) -> list[str]:
        """End every MPS client of the GPU and, where it serves that GPU alone, its server; then start the
        GPU's lanes again and judge the recovery in later rounds. The phase times (fault reported, detected
        here, clients ended, MPS restarted, lanes started, then live and first batch measured, filled in by
        later rounds) go into the event: where a recovery's seconds go."""
        from services.measurer.gpu import GpuAttempt

        reported = [f["at"] for f in event.get("faults", ()) if f.get("gpu8") == gpu8]
        phases = {"fault_at": min(reported) if reported else None, "detected_at": event["detected_at"]}
        event.setdefault("phases", {})[gpu8] = phases
        lanes = self.lane_names(gpu8)
        event.setdefault("gpu_resets", {})[gpu8] = self._reset_clients(gpu8, phases)
        for name in lanes:
            self.restart_lane(name)
        phases["lanes_started_at"] = time.time()
        self.phases[gpu8] = phases
        self.attempts[gpu8] = GpuAttempt(gpu8, restarted_at=time.time(), failures=self.failures.get(gpu8, 0))
        return lanes

    def _reset_clients(self, gpu8: str, phases: dict | None = None) -> dict:
        """Every process the agent started for the GPU (lanes, build pools: whole sessions, exited leaders
        included) and every other client of the MPS server serving it, ended by PID; other GPUs' lanes and
        their children are never touched. The server goes too when it serves this GPU alone. Returns what
        was done (errors as data)."""
        from services.measurer.gpu import plan_gpu_reset

        procs, mine = self.processes.procs, self.lane_names(gpu8)
        gpu_roots = [procs[n].pid for n in mine if n in procs]
        # exited ones too: their sessions (a build pool left behind) belong to their own GPU
        other_roots = [p.pid for n, p in procs.items() if n in self.lane_procs and n not in mine]
        servers = self.mps.servers() if self.mps is not None else {}
        plan = plan_gpu_reset(self.host.table(), gpu_roots, other_roots, servers,
                              daemon_is_ours=bool(self.mps is not None and self.mps.started), me=os.getpid())
        done = {"servers": {str(k): list(v) for k, v in servers.items()}, "end": list(plan.end),
                "kill_servers": list(plan.kill_servers), "kept_servers": list(plan.kept), "quit_daemon": plan.quit_daemon}
        # a faulted GPU's clients hold nothing worth a long warm shutdown: a short grace, then SIGKILL
        done["clients"] = self.host.end(plan.end, grace_s=CLIENT_GRACE_S)
        for name in mine:  # reap the leaders we started (no zombies left behind)
            try:
                if name in procs:
                    procs[name].wait(5)
            except subprocess.TimeoutExpired:
                done.setdefault("unreaped", []).append(procs[name].pid)
        try:
            self._forget_lanes(gpu8, set(gpu_roots))
        except Exception as err:  # noqa: BLE001 - Redis restarting: the keys lapse by their TTL instead
            done["forget_error"] = str(err)
        if phases is not None:
            phases["clients_ended_at"] = time.time()
        # the servers go by PID before the daemon is asked to quit: a server that still counts clients (a
        # faulted one does, for a while after they exited) holds a 'quit' for its 10 s timeout
        done["servers_ended"] = self.host.end(plan.kill_servers, grace_s=5.0)
        if plan.quit_daemon:
            self._restart_daemon(done)
        if phases is not None:
            phases["mps_restarted_at"] = time.time() if plan.quit_daemon else None
        self.config.log.warning("GPU %s reset: %s", gpu8, done)
        return done

    def _restart_daemon(self, done: dict) -> None:
        try:
            self.mps.stop()  # waits until the daemon is gone (its servers were ended before)
        except Exception as err:  # noqa: BLE001 - the daemon outlived its servers: its lanes will say so
            done["daemon_error"] = str(err)
        try:
            self.mps.start()
        except Exception as err:  # noqa: BLE001 - lanes refuse to run without a daemon: the recovery fails
            done["daemon_error"] = str(err)
            self.config.log.error("MPS daemon restart failed", exc_info=True)

    def _forget_lanes(self, gpu8: str, pids: set[int]) -> None:
        """The ended lanes' liveness keys and their entries in the GPU's gate go at once: a tuner re-sends
        what they held without waiting out their TTL, and a suspect of the restarted lanes does not wait for
        a dead lane's candidate."""
        r = store.connect(self.config.redis_url)
        for info in store.live_lanes(r):
            if info.pid in pids and lane_kinds.fault_domain(info.queue) == gpu8:
                store.retire_lane(r, info)
        store.clear_gpu_isolation(r, gpu8)

    def _judge(self, now: float, faulted: set[str], faults=()) -> tuple[set[str], set[str]]:
        """Judge each GPU recovery in doubt (services.measurer.gpu.judge_recovery): returns the GPUs to
        recover again (their lanes never came back) and those to give up (recoveries failed twice in a row).
        A fault a restarted lane reports with its candidate shows the lanes measuring again: a new incident."""
        from services.measurer.gpu import Verdict, give_up_gpu, judge_recovery, measured_by_fault

        retry, give_up = set(), set()
        for gpu8, attempt in list(self.attempts.items()):
            attempt = measured_by_fault(self._observe(attempt, now), faults)
            verdict = judge_recovery(attempt, now, now if gpu8 in faulted else None)
            if verdict == Verdict.PENDING:
                self.attempts[gpu8] = attempt
                continue
            del self.attempts[gpu8]
            self.failures[gpu8] = 0 if verdict == Verdict.OK else attempt.failures + 1
            if verdict == Verdict.FAILED:
                (give_up if give_up_gpu(self.failures[gpu8]) else retry).add(gpu8)
        return retry, give_up

    def _observe(self, attempt, now: float):
        """When every lane of the GPU was live again, and when one of them had answered a batch."""
        procs = self.processes.procs
        pids = {procs[n].pid for n in self.lane_names(attempt.gpu8) if n in procs}
        live = [l for l in store.live_lanes(store.connect(self.config.redis_url)) if l.pid in pids]
        phases = self.phases.get(attempt.gpu8, {})
        if attempt.live_at is None and pids and len({l.pid for l in live}) >= len(pids):
            attempt = replace(attempt, live_at=now)
            phases["lanes_live_at"] = now
        if attempt.measured_at is None and any(l.batches > 0 for l in live):
            attempt = replace(attempt, measured_at=now)
            phases["first_batch_at"] = now
        return attempt

    def _give_up_gpu(self, gpu8: str, faults) -> dict:
        """Stop the GPU's lanes for good (their clients ended, so the MPS server holds nothing of them) and
        write a clear error to the store: the lanes view and the jobs that used the GPU show it."""
        lanes = self.lane_names(gpu8)
        queues = sorted({self.lane_procs[n][0] for n in lanes})
        reset = self._reset_clients(gpu8)
        last = next((f.error for f in reversed(faults) if f.gpu8 == gpu8), None)
        why = (f"GPU {self.uuids.get(gpu8, gpu8)} given up: {self.failures.get(gpu8, 0)} recoveries in a row "
               f"failed (lanes did not come back measuring, or faulted again at once); its lanes {', '.join(queues)} "
               f"are stopped, other GPUs' lanes go on" + (f"; last fault: {last[:300]}" if last else ""))
        self.given_up[gpu8] = why
        for name in lanes:
            self.processes.procs.pop(name, None)
            self.lane_procs.pop(name, None)
            self.processes.given_up[name] = why
        reset["jobs"] = store.give_up_gpu(store.connect(self.config.redis_url), gpu8, why, queues)
        self.config.log.error(why)
        return reset
