"""Programmatic submission: `Client(redis_url).submit(model, target="llvm", share=50, trials=64)`.

The client converts the model to a Relax IRModule here (so torch never has to be installed beside the
services), stores it in Redis with the job's spec, and sends the job to the planner by name."""
from __future__ import annotations

import time
import uuid
from typing import Any

from shared import lanes, names, store
from services.celery_app import make_celery
from shared.errors import JobError, ModelError, StoreError
from shared.messages import (FINAL_STATES, MAX_MODEL_BYTES, JobOptions, JobRef, JobResult, JobSpec, JobState,
                             TaskProgress, check_share, lane_kind)
from shared.ranking import default_secs



class Job:
    def __init__(self, client: "Client", job_id: str):
        self.client, self.job_id = client, job_id

    def __repr__(self) -> str:
        return f"Job({self.job_id!r})"

    def state(self) -> dict:
        return store.job_state(self.client.redis, self.job_id)

    def status(self) -> dict:
        """State, and per task: trials, errors, best latency (µs) so far."""
        st = self.state()
        tasks = {t.task_id: t for t in store.job_tasks(self.client.redis, self.job_id)}
        progress = store.job_progress(self.client.redis, self.job_id)
        # once the job has its result, a task's best is the result's: one best in status and results
        result = store.job_result(self.client.redis, self.job_id) if st.get("state") in FINAL_STATES else None
        final = {b.task_id: b for b in result.tasks} if result else {}
        defaults = store.default_timings(self.client.redis, [t.wkey for t in tasks.values()])
        rows = []
        for tid, t in tasks.items():
            p = progress.get(tid) or TaskProgress(task_id=tid, name=t.name)
            default_s = default_secs(defaults[t.wkey])
            rows.append({"task": t.name, "weight": t.weight, "trials": p.trials, "errors": p.errors,
                         "best_us": final[tid].best_us if tid in final else p.best_us,
                         "default_us": 1e6 * default_s if default_s else None, "reused_trials": p.reused_trials})
        spec = store.job_spec(self.client.redis, self.job_id)
        shards = [{"shard": sh.shard, "state": sh.state, "owner": sh.owner, "attempts": sh.attempts,
                   "tasks": len(sh.task_ids)} for sh in store.shards(self.client.redis, self.job_id).values()]
        quarantined = [{"candidate": q.candidate_hash, "error": q.error, "crashes": q.crashes, "lane": q.lane}
                       for q in store.quarantined_all(self.client.redis, self.job_id)]
        stamps = {k: float(v) for k, v in st.items() if k.endswith("_at") and _number(v)}
        # a GPU the supervisor gave up names itself here even while the job goes on (or waits) elsewhere
        error = st.get("error") or st.get("gpu_error")
        return {"job_id": self.job_id, "name": spec.name, "state": st.get("state"), "error": error,
                "gpu_error": st.get("gpu_error"), "waiting_for": st.get("waiting_for"), "advice": st.get("advice"),
                "stopped": st.get("stopped"), "stopping": _stopping(spec, st),
                "target": spec.target, "share": spec.share, "budget": spec.trials,
                "trials": sum(r["trials"] for r in rows), "submitted_at": spec.submitted_at, "times": stamps,
                "tasks": rows, "shards": shards, "quarantined": quarantined,
                "accounting": store.trial_accounting(self.client.redis, self.job_id)}

    def cancel(self) -> str:
        """Stop the job after the round in flight; returns its state afterwards (done/failed stay)."""
        return store.cancel_job(self.client.redis, self.job_id)

    def wait(self, timeout_s: float | None = None, poll_s: float = 0.5, on_progress=None) -> dict:
        deadline = None if timeout_s is None else time.time() + timeout_s
        while True:
            st = self.status() if on_progress else self.state()
            if on_progress:
                on_progress(st)
            if st.get("state") in FINAL_STATES:
                return st
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"job {self.job_id} still {st.get('state')} after {timeout_s} s")
            time.sleep(poll_s)

    def result(self) -> JobResult:
        st = self.state()
        if st.get("state") == JobState.FAILED:
            raise JobError(f"job {self.job_id} failed: {st.get('error')}")
        res = store.job_result(self.client.redis, self.job_id)
        if res is None:
            raise JobError(f"job {self.job_id} has no result yet (state {st.get('state')})")
        return res

    def _inputs(self, spec) -> list:
        """The model's inputs (shape, dtype): recorded at submit, else read from its model while it is kept."""
        if spec.inputs is not None:
            return [(tuple(shape), dtype) for shape, dtype in spec.inputs]
        try:
            blob = store.job_model(self.client.redis, self.job_id)
        except JobError:
            raise JobError(f"job {self.job_id}'s model left the store an hour after the job ended, and the job "
                           "predates recorded inputs: time its modules with `python -m sharetune.experiments.model_timing`") from None
        from services.tuner.metaschedule.ir_codec import load_ir
        from sharetune.intake import _main_inputs

        return _main_inputs(load_ir(blob.decode()), "the job's model")

    def latency_us(self, rounds: int = 10, timeout_s: float = 300.0) -> dict:
        """End-to-end latency (µs, median of `rounds`) of the tuned and the untuned model: a CPU job's
        compiled modules timed on this host in a fresh process pinned to as many cores as its lanes
        hold. {"tuned": .., "untuned": .., "errors": {..}}; kept in the job's state once measured."""
        import json
        import os
        import subprocess
        import sys
        import tempfile

        import numpy as np

        cached = store.job_hash(self.client.redis, self.job_id).latency_us
        if cached:
            return cached
        res, spec = self.result(), store.job_spec(self.client.redis, self.job_id)
        if not lanes.for_target(spec.target).runs_on_host_cores:
            raise JobError("the end-to-end latency is timed for CPU jobs only (serve a GPU job's module at its share)")
        modules = {k: p for k, p in (("tuned", res.tuned_module_path), ("untuned", res.untuned_module_path))
                   if p and os.path.exists(p)}
        if not modules:
            raise JobError(f"job {self.job_id}'s compiled modules are not on this host")
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal(shape).astype(dtype) for shape, dtype in self._inputs(spec)]
        queues = set(store.job_hash(self.client.redis, self.job_id).lanes or [])
        cores = next((l.cores for l in self.client.lanes() if l.queue in queues and l.cores), None)
        n = len(cores) if cores else max(1, round((os.cpu_count() or 1) * spec.share / 100))
        with tempfile.TemporaryDirectory() as tmp:
            np.savez(f"{tmp}/inputs.npz", **{f"arg{i}": x for i, x in enumerate(inputs)})
            argv = [sys.executable, "-m", "sharetune.experiments.model_timing", "--device", "cpu", "--cores",
                    ",".join(str(c) for c in range(n)), "--inputs", f"{tmp}/inputs.npz", "--rounds", str(rounds)]
            argv += [f"--module={k}={p}" for k, p in modules.items()]
            repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = {**os.environ, "TVM_NUM_THREADS": str(n), "OMP_NUM_THREADS": str(n), "CUDA_VISIBLE_DEVICES": "",
                   "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]
            raise JobError(f"timing job {self.job_id}'s modules failed: {tail}")
        out = json.loads(lines[-1])
        lat = {**out["latency_us"], "errors": out["errors"], "cores": n}
        store.update_job(self.client.redis, self.job_id, latency_us=lat)
        return lat


def _number(v) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


CONNECT_TIMEOUT_S = 3.0


def check_reachable(redis_url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """One ping with a connect timeout, no retries: a stale or missing Redis is a one-line StoreError
    in seconds, not a minute of the store's restart-riding retries and a traceback."""
    why = store.unreachable(redis_url, timeout_s)
    if why is not None:
        raise StoreError(f"cannot reach Redis at {_redacted(redis_url)}: {why} (is the stack up? `sharetune up` "
                         f"prints the REDIS_URL to export)")


def _redacted(url: str) -> str:
    """The URL without its password."""
    import re

    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


class Client:
    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        check_reachable(redis_url)
        self.redis = store.connect(redis_url)
        self.app = make_celery("client", redis_url)

    def submit(self, model: Any, *, example_inputs=None, **options) -> Job:
        """Submit a model (torch nn.Module + example_inputs, ONNX path/bytes/ModelProto, Relax IRModule,
        or a zoo name) for tuning. `options` are JobOptions' fields (shared.messages: their defaults, ranges and
        meaning), e.g. `target="cuda", share=25, trials=512, trials_per_iter=64`. Bad input raises a clear
        error here, before anything is queued.

        `share` None: the share of the live lanes of the target's kind when they all agree. A share no live
        lane serves is refused (ShareError naming the shares served) unless `wait_for_lanes`: then the
        job waits, parked, until such a lane appears or it is cancelled. `clients` tuner clients search its
        tasks at once (default: one per live tuner client), spending `trials` together."""
        from sharetune.intake import to_relax

        if options.get("share") is not None:
            check_share(options["share"])
        kind = lane_kind(options.get("target", JobOptions.model_fields["target"].default))  # TargetError names it
        opts = JobOptions.checked(**options)
        share = self._share_for(kind, opts.share, opts.wait_for_lanes)
        _check_model_size(model)
        relax_model = to_relax(model, example_inputs)
        job_id = uuid.uuid4().hex[:12]
        from sharetune.intake import _main_inputs

        try:
            inputs = [(list(shape), dtype) for shape, dtype in _main_inputs(relax_model.mod, "the model")]
        except ModelError:
            inputs = None  # not static tensors: tuned all the same, timed end to end only while its model is kept
        spec = JobSpec(**{**opts.model_dump(), "job_id": job_id, "share": share, "inputs": inputs,
                          "name": opts.name or (model if isinstance(model, str) else type(model).__name__)})
        from services.tuner.metaschedule.ir_codec import dump_ir  # the IR format the planner reads

        blob = dump_ir(relax_model.mod).encode()
        if len(blob) > MAX_MODEL_BYTES:
            raise ModelError(f"the model's Relax form is {len(blob)} bytes, over the limit of {MAX_MODEL_BYTES} bytes")
        store.create_job(self.redis, spec, blob)
        ref = JobRef(job_id=job_id, plan=uuid.uuid4().hex)
        store.plan_sent(self.redis, job_id, ref.plan)
        self.app.send_task(names.PLAN_TASK, args=[ref.model_dump(mode="json")], queue=names.PLAN_QUEUE)
        return Job(self, job_id)

    def _share_for(self, kind: str, share: int | None, wait_for_lanes: bool) -> int:
        served = lanes.shares_served(self.lanes(), kind)
        return lanes.LiveLanePolicy().share_at_submit(served, kind, share, wait_for_lanes)  # no timeout of it applies

    def job(self, job_id: str) -> Job:
        store.job_hash(self.redis, job_id)  # raises JobError if unknown
        return Job(self, job_id)

    def jobs(self, limit: int = 50) -> list[Job]:
        """The newest jobs in the store, newest first."""
        return [Job(self, j) for j in store.jobs(self.redis, limit)]

    def lanes(self):
        return store.live_lanes(self.redis)

    def gpus_down(self) -> dict[str, dict]:
        """GPUs the supervisor gave up (gpu8 -> {error, lanes, at}), unless lanes of them live again."""
        return still_down(store.gpus_down(self.redis), self.lanes())


def _check_model_size(model) -> None:
    """Refuse an oversized model before parsing it (a 100 MB payload is an error, not a memory spike)."""
    import os

    if isinstance(model, (bytes, bytearray, memoryview)):
        size, what = len(model), "the given model data"
    elif isinstance(model, (str, os.PathLike)) and os.path.isfile(model):
        size, what = os.path.getsize(model), f"model file {model}"
    else:
        return
    if size > MAX_MODEL_BYTES:
        raise ModelError(f"{what} is {size} bytes, over the limit of {MAX_MODEL_BYTES} bytes")


def still_down(down: dict[str, dict], live) -> dict[str, dict]:
    """A given-up GPU whose lanes were started again later (a new stack) is no longer down."""
    return {g: e for g, e in down.items()
            if not any(lanes.fault_domain(l.queue) == g and l.started_at > e["at"] for l in live)}


def _stopping(spec, st: dict) -> dict | None:
    """The job's stopping rules and where patience's count stands (None without rules)."""
    if spec.time_limit_s is None and spec.patience is None:
        return None
    mark = st.get("estimate_mark_trials")
    return {"time_limit_s": spec.time_limit_s, "patience": spec.patience, "min_gain_pct": spec.min_gain_pct,
            "mark_trials": int(mark) if mark is not None else None}
