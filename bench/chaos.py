"""A chaos soak: a local stack (CPU lanes, builders, tuner clients, the planner, the updater, its embedded Redis)
runs a stream of jobs while a driver kills a random service process with SIGKILL every 5-30 s and pushes junk on
random queues; at the end every job must be done (or failed with a reason), with claimed trials = records, none
lost or counted twice, and memory bounded. Kills stay within the supervisor's restart budget (a process killed more
often is given up by design: tests/test_supervisor.py). Writes `$OUT/chaos.json` (default
bench/results/chaos.json). Protocol and results: docs/hardening.md (The chaos soak).

    python -m bench.chaos --duration-s 2100                   # the soak (~40 min on a 2-core host)
    python -m bench.chaos --duration-s 120 --out /tmp/c.json  # a short one (tests/test_chaos.py runs this)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from bench.harness.common import results_path, wait_for, write_results
from bench.harness.jobs import local_stack
from services.measurer.agent import MAX_RESTARTS, RESTART_WINDOW_S
from shared import names, store
from sharetune.testing.faults import job_audit

FINAL = ("done", "failed", "cancelled")
JUNK = [b"\x00\xffnot an envelope", b"[1, 2, 3]", b'{"hello": "world"}', b'{"properties": {}}',
        b'{"body": "***", "properties": {"delivery_tag": "x", "body_encoding": "base64", "delivery_info": {}}}']


class Chaos:
    """The driver: its kills and junk, logged; one thread each."""

    def __init__(self, stack, rng: random.Random, kill_every_s: tuple[float, float], junk_every_s: float):
        self.stack, self.rng = stack, rng
        self.kill_every_s, self.junk_every_s = kill_every_s, junk_every_s
        self.kills: list[dict] = []
        self.junk = 0
        self.stop = threading.Event()
        self.r = store.connect(stack.redis_url)

    def _victims(self, now: float) -> list[tuple[str, int]]:
        """(name, pid) of each live process whose kills in the restart window leave it a restart to spare."""
        recent = {}
        for k in self.kills:
            if now - k["at"] < RESTART_WINDOW_S:
                recent[k["name"]] = recent.get(k["name"], 0) + 1
        out = [(n, p.pid) for n, p in list(self.stack.procs.items()) if p.poll() is None]
        srv = self.stack.redis_server
        if srv is not None and srv.proc is not None and srv.proc.poll() is None:
            out.append(("redis", srv.proc.pid))
        return [(n, pid) for n, pid in out if recent.get(n, 0) < MAX_RESTARTS - 1]

    def kill_loop(self, t0: float) -> None:
        while not self.stop.wait(self.rng.uniform(*self.kill_every_s)):
            victims = self._victims(time.time())
            if not victims:
                continue
            name, pid = self.rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)  # a process this run's stack started, by its PID
            except ProcessLookupError:
                continue
            self.kills.append({"at": time.time(), "t": round(time.time() - t0, 1), "name": name, "pid": pid})

    def junk_loop(self) -> None:
        while not self.stop.wait(self.junk_every_s):
            queues = [names.PLAN_QUEUE, names.TUNE_QUEUE, names.COSTMODEL_QUEUE] + [q for q, _ in
                                                                                   self.stack.agent.lane_procs.values()]
            queues += [names.build_queue(f) for f in set(self.stack.agent.builder_procs.values())]
            try:
                self.r.lpush(self.rng.choice(queues), self.rng.choice(JUNK))
                self.junk += 1
            except Exception:  # noqa: BLE001 - Redis is being killed too: the next push goes through
                pass


def rss_mib(stack) -> float:
    import psutil

    total = 0
    for p in list(stack.procs.values()):
        try:
            proc = psutil.Process(p.pid)
            total += sum(x.memory_info().rss for x in [proc] + proc.children(recursive=True))
        except psutil.Error:
            pass
    return total / 2**20


def all_final(r, jobs: list[str]) -> bool:
    try:
        return all(store.job_state(r, j).get("state") in FINAL for j in jobs)
    except Exception:  # noqa: BLE001 - Redis still coming back from the last kill
        return False


def soak(work: Path, duration_s: float, seed: int = 0, kill_every_s=(5.0, 30.0), junk_every_s: float = 3.0,
         trials: int = 16, max_active: int = 2, drain_s: float = 900.0, tuners: int = 2, builders: int = 1,
         log=print) -> dict:
    from sharetune.client import Client
    from sharetune.stack.local import LocalRedis

    rng = random.Random(seed)
    stack = local_stack(work, ["measure.cpu.c0", "measure.cpu.c1"], tuners, builders, local_redis=LocalRedis(restart=True))
    stack.start(wait_lanes_s=300)
    try:
        client = Client(stack.redis_url)
        r = store.connect(stack.redis_url)
        share = client.lanes()[0].share
        chaos = Chaos(stack, rng, kill_every_s, junk_every_s)
        t0 = time.time()
        rss0 = rss_mib(stack)
        threads = [threading.Thread(target=chaos.kill_loop, args=(t0,), daemon=True),
                   threading.Thread(target=chaos.junk_loop, daemon=True)]
        for t in threads:
            t.start()
        jobs, models, n = [], ["tiny", "small_cnn"], 0
        while time.time() - t0 < duration_s:
            try:
                active = [j for j in jobs if store.job_state(r, j).get("state") not in FINAL]
                if len(active) < max_active:
                    job = client.submit(models[n % len(models)], target="llvm", share=share, trials=trials,
                                        trials_per_iter=8, seed=n)
                    jobs.append(job.job_id)
                    n += 1
            except Exception as err:  # noqa: BLE001 - a submit while Redis is down: try again
                log(f"submit: {type(err).__name__}: {err}")
            time.sleep(2)
        chaos.stop.set()
        for t in threads:
            t.join()
        chaos_s = time.time() - t0
        log(f"chaos over after {chaos_s:.0f} s: {len(chaos.kills)} kills, {chaos.junk} junk entries, "
            f"{len(jobs)} jobs; draining")
        wait_for(lambda: all_final(r, jobs), drain_s, 2)
        audits = [job_audit(r, j) for j in jobs]
        wait_for(lambda: r.llen(names.DEADLETTER_KEY) >= chaos.junk, 60, 1)  # the last junk reaches its workers
        dead_letters = r.llen(names.DEADLETTER_KEY)
        given_up = [row["name"] for row in stack.services() if row.get("given_up")]
        unaccounted = [a["job_id"] for a in audits if a["state"] not in FINAL or (a["state"] == "failed" and not a["error"])
                       or (a["state"] == "done" and a["claimed"] != a["recorded"])]
        summary = {
            "duration_s": round(chaos_s, 1), "kills": len(chaos.kills), "junk_entries": chaos.junk,
            "dead_letters": dead_letters, "jobs": len(jobs),
            "jobs_done": sum(a["state"] == "done" for a in audits),
            "jobs_failed": sum(a["state"] == "failed" for a in audits),
            "jobs_unaccounted": len(unaccounted),
            "lost": sum(a["lost"] or 0 for a in audits if a["state"] == "done"),
            "duplicated": sum(a["duplicated"] for a in audits),
            "workers_given_up": len(given_up) + (stack.redis_given_up is not None),
            "rss_mib_start": round(rss0, 1), "rss_mib_end": round(rss_mib(stack), 1),
            "redis_used_mib_end": round(store.memory(r)["used_bytes"] / 2**20, 1),
        }
        kinds = {}
        for k in chaos.kills:
            kind = k["name"].rstrip("0123456789").rstrip("-")
            kinds[kind] = kinds.get(kind, 0) + 1
        return {"summary": summary, "kills_by_kind": kinds, "given_up": given_up, "unaccounted": unaccounted,
                "jobs": audits, "kills": [{k: v for k, v in x.items() if k != "at"} for x in chaos.kills],
                "protocol": {"lanes": 2, "builders": builders, "tuners": tuners, "trials": trials, "max_active": max_active,
                             "kill_every_s": list(kill_every_s), "junk_every_s": junk_every_s, "seed": seed,
                             "host_cpus": os.cpu_count()}}
    finally:
        stack.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tuners", type=int, default=3)
    ap.add_argument("--builders", type=int, default=3, help="more processes to kill: each may die 4 times in 10 min")
    ap.add_argument("--work-dir", default="/tmp/sharetune-chaos")
    ap.add_argument("--out", default=None, help="the JSON (default $OUT/chaos.json, else bench/results/chaos.json)")
    args = ap.parse_args(argv)
    import shutil

    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stack it started, as for Ctrl-C
    result = soak(work, args.duration_s, seed=args.seed, tuners=args.tuners, builders=args.builders,
                  log=lambda m: print(m, flush=True))
    write_results(result, results_path("chaos.json", args.out), "bench.chaos", argv)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
