"""A job on a local stack: the stack, the lanes it gets, its submit and wait, and its records afterwards."""
from __future__ import annotations

import os
import time

USER_CACHE = os.environ.get("SHARETUNE_CUDA_COMPILE_CACHE_DIR")  # kept; else each stack builds cold (benchmarks.md)


def gpus() -> list:
    """This host's GPUs (NVML), named by UUID."""
    from services.measurer.observers import make_observer

    return make_observer().inventory()


def gpu_lane(uuid: str, pct: int) -> str:
    """The queue of a lane at `pct` % of the GPU `uuid`."""
    from shared.ids import gpu8

    return f"measure.{gpu8(uuid)}.p{pct}"


def local_stack(work, lanes: list[str], tuners: int | None = None, builders: int = 0, builder_cores: str | None = None,
                **kw):
    """A local stack in `work` (not started: use it as a context), logging at INFO, settings from the environment."""
    from services.measurer.agent import BuilderSpec
    from shared.settings import StackSettings
    from sharetune.stack.local import Stack

    os.environ["SHARETUNE_CUDA_COMPILE_CACHE_DIR"] = USER_CACHE or f"{work}/cuda-cache"
    return Stack(work, lanes=lanes, tuners=tuners, builders=BuilderSpec(builders, builder_cores), log_level="INFO",
                 settings=StackSettings(), **kw)


def run_job(client, timeout_s: float, cancel_on_timeout: bool = False, **submit):
    """(job, its final state, seconds from submit): a job that outlasts `timeout_s` ends as state "timeout"."""
    t0 = time.time()
    job = client.submit(**submit)
    try:
        final = job.wait(timeout_s=timeout_s, on_progress=None)
    except TimeoutError as err:
        if cancel_on_timeout:
            job.cancel()
        final = {"state": "timeout", "error": str(err)}
    return job, final, time.time() - t0


def job_records(r, job_id: str) -> list[tuple]:
    """(record, task) of every trial of the job, in the order they were measured."""
    from shared import store

    out = [(x, t) for t in store.job_tasks(r, job_id) for x in store.records(r, t.wkey) if x.job_id == job_id]
    return sorted(out, key=lambda p: p[0].measured_at)
