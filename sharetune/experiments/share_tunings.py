"""A share matrix's tunings: one isolated job per (share, seed), one after another, each finished one kept on
disk, so that a stopped run, or one split across sessions on fresh machines, resumes with the missing tunings
only.

A tuning is keyed by (model, share, seed, trials) (tuning_key). What is kept of it (KeptTunings: a folder per
key) is its job's facts and tasks (tuning.json) and its database cut to each workload's best record (TVM's JSON
database files): what its tuned module was compiled from, so that the module is compiled again from it where
the module itself is gone (another machine), and what the per-task picture builds each task's best schedule
from. Each job is isolated (JobOptions.isolated): no tuning reuses, is seeded from or applies another's records,
so the tunings of a share are replicates of its search, and no share's tuning starts from another share's."""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from shared.messages import JobState

WORKLOADS, RECORDS = "database_workload.json", "database_tuning_record.json"  # TVM's JSONDatabase files
MIN_TUNING_S = 30.0  # a tuning is not started with less time than this left (or than earlier tunings took)


# ---- what a tuning is and which are missing (pure) ----------------------------------------------------


def tuning_key(model: str, share: int, seed: int, trials: int) -> str:
    """The tuning's name on disk and in a matrix's jobs: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{model}-p{share}-s{seed}-t{trials}")


def label(share: int, seed: int) -> str:
    """A tuned module's label among those a serving process times."""
    return f"{share}s{seed}"


def tuning_plan(shares: list[int], seeds: list[int]) -> list[tuple[int, int]]:
    """(share, seed) in the order they are tuned: every share's first seed, then every share's second, ... so a
    run stopped part-way still has a whole matrix of fewer tunings."""
    return [(share, seed) for seed in seeds for share in shares]


def missing_tunings(plan: list[tuple[int, int]], model: str, trials: int, finished: set[str]) -> list[tuple[int, int]]:
    """The planned tunings whose key is not among the finished ones: what a resumed run still tunes."""
    return [(p, seed) for p, seed in plan if tuning_key(model, p, seed, trials) not in finished]


def best_record_lines(lines: list[str]) -> list[str]:
    """A JSON database's tuning records cut to each workload's best (the lowest mean run time, as TVM applies
    it; the first of equals), in workload order: what compiles into the same module."""
    best: dict[int, tuple[float, str]] = {}
    for line in lines:
        if not line.strip():
            continue
        workload, record = json.loads(line)
        secs = record[1] or []
        mean = sum(secs) / len(secs) if secs else float("inf")
        if workload not in best or mean < best[workload][0]:
            best[workload] = (mean, line)
    return [best[w][1] for w in sorted(best)]


# ---- kept tunings ---------------------------------------------------------------------------------------


class KeptTuning(BaseModel):
    """A finished tuning as kept (tuning.json): `tasks` (the job's TaskBest, as dicts) in the order of its
    database's workloads; `module`: where its tuned module was compiled (gone on another machine); `target`:
    the TVM target JSON it was tuned and compiled for."""

    model_config = ConfigDict(extra="forbid")

    key: str
    model: str
    share: int
    seed: int
    trials: int
    only_tasks: list[str] | None = None
    target: str
    job: dict[str, Any]
    tasks: list[dict[str, Any]]
    module: str | None = None
    kept_at: float = 0.0


class KeptTunings:
    """A folder of finished tunings, one subfolder per tuning key."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def database(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str, only_tasks: list[str] | None = None) -> KeptTuning | None:
        """The kept tuning of this key over the same tasks, when whole (its facts and its database)."""
        d = self.database(key)
        if not all((d / name).is_file() for name in ("tuning.json", WORKLOADS, RECORDS)):
            return None
        kept = KeptTuning.model_validate_json((d / "tuning.json").read_text())
        return kept if kept.only_tasks == only_tasks else None

    def finished(self, only_tasks: list[str] | None = None) -> set[str]:
        return {d.name for d in self.root.glob("*") if self.get(d.name, only_tasks) is not None}

    def modules_gone(self, keys: list[str], only_tasks: list[str] | None = None) -> int:
        """How many of these kept tunings have to be compiled again (their module is not on this machine)."""
        kept = [self.get(key, only_tasks) for key in keys]
        return sum(1 for k in kept if k is not None and not (k.module and Path(k.module).is_file()))

    def keep(self, kept: KeptTuning, database_dir: str | Path) -> KeptTuning:
        """Keep a finished tuning: its facts, and its exported database cut to each workload's best record
        (written beside, then moved in: a folder is whole or absent)."""
        final, part = self.database(kept.key), self.root / f".{kept.key}.part"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        shutil.copy(Path(database_dir) / WORKLOADS, part / WORKLOADS)
        lines = (Path(database_dir) / RECORDS).read_text().splitlines()
        (part / RECORDS).write_text("".join(line + "\n" for line in best_record_lines(lines)))
        kept = kept.model_copy(update={"kept_at": time.time()})
        (part / "tuning.json").write_text(kept.model_dump_json(indent=1))
        shutil.rmtree(final, ignore_errors=True)
        part.rename(final)
        return kept

    def modules(self, kept: list[KeptTuning], relax_mod, out_dir: Path,
                parallel: int | None = None) -> tuple[dict[str, str], dict[str, str]]:
        """Each tuning's module by key: where it was compiled when still there, else compiled again from its kept
        database (a run resumed on another machine), `parallel` child processes at a time (default a quarter of
        the cores); and why a tuning has none, by key."""
        have = {k.key: k.module for k in kept if k.module and Path(k.module).is_file()}
        todo = [k for k in kept if k.key not in have]
        errors: dict[str, str] = {}
        if not todo:
            return have, errors
        from services.tuner.metaschedule.ir_codec import dump_ir

        out_dir.mkdir(parents=True, exist_ok=True)
        ir = out_dir / "model.ir.json"
        ir.write_text(dump_ir(relax_mod))
        from sharetune.experiments.children import run_modules

        width = parallel or max(1, (os.cpu_count() or 1) // 4)
        ran = run_modules({k.key: [__name__, "--ir", str(ir), "--db", str(self.database(k.key)), "--target", k.target,
                                   "--out", str(out_dir / f"{k.key}.so")] for k in todo}, width)
        for key, (code, last) in ran.items():
            if code == 0 and (out_dir / f"{key}.so").is_file():
                have[key] = str(out_dir / f"{key}.so")
            else:
                errors[key] = f"its kept database did not compile: {last}"[:400]
        return have, errors


# ---- running them ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replicates:
    """How many tunings each share gets (search seeds seed, seed + 1, ...), where finished ones are kept
    (None: the matrix's work dir, tunings/), and whether kept ones are used instead of tuning again."""

    tunings: int = 1
    seed: int = 0
    kept_dir: Path | None = None
    resume: bool = False

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(max(1, self.tunings))]


@dataclass(frozen=True)
class ShareTuning:
    """How the model's job at each share is run: `submit(share=, seed=, name=)` submits it, `trials` its budget
    (`budget` says it for the log), waited for `timeout_s` at most (`on_timeout(job)` may stop one still running);
    what happens is told to `log`, each line naming the model."""

    model: str
    submit: Callable[..., Any]
    trials: int
    budget: str
    timeout_s: float
    on_timeout: Callable[[Any], None] | None
    log: Callable[[str], None]

    def say(self, message: str) -> None:
        self.log(f"[matrix {self.model}] {message}")


class TuningRun:
    """A matrix's tunings, run or found kept: `jobs` (by tuning key) and `errors` (by "<share>:<seed>@*") say what
    happened to each; `tuned` holds each finished one."""

    def __init__(self, tuning: ShareTuning, kept: KeptTunings, only_tasks: list[str] | None = None):
        self.tuning, self.kept, self.only_tasks = tuning, kept, only_tasks
        self.jobs: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.tuned: dict[tuple[int, int], KeptTuning] = {}
        self.walls: list[float] = []

    def key(self, share: int, seed: int) -> str:
        return tuning_key(self.tuning.model, share, seed, self.tuning.trials)

    def run(self, plan: list[tuple[int, int]], resume: bool, deadline: tuple[float | None, float],
            after_each: Callable[[], None]) -> None:
        """Tune each planned (share, seed) in turn, a kept one used when `resume`; one is skipped when `deadline`
        (time.time(), and the seconds kept for serving) leaves less than the longest earlier tuning took, kept
        ones included (MIN_TUNING_S before the first)."""
        until, serve_reserve_s = deadline
        for share, seed in plan:
            key = self.key(share, seed)
            kept = self.kept.get(key, self.only_tasks) if resume else None
            if kept is not None:
                self.tuned[(share, seed)] = kept
                self.jobs[key] = dict(kept.job, resumed=True)
                self.walls.append(float(kept.job.get("wall_s") or 0.0))  # how long the next one may take
                self.tuning.say(f"share {share} %, seed {seed}: tuned by an earlier run (job {kept.job.get('job_id')}), kept")
                continue
            left = None if until is None else until - serve_reserve_s - time.time()
            need = max([MIN_TUNING_S] + self.walls)
            if left is not None and left < need:
                self.errors[f"{share}:{seed}@*"] = (f"not tuned: {left + serve_reserve_s:.0f} s left before the deadline, "
                                                    f"{serve_reserve_s:.0f} s of them kept for serving")
                self.tuning.say(f"share {share} %, seed {seed}: skipped, out of time (a tuning takes ~{need:.0f} s)")
                continue
            self.tune(share, seed, None if left is None else max(MIN_TUNING_S, min(self.tuning.timeout_s, left)))
            after_each()

    def tune(self, share: int, seed: int, timeout_s: float | None) -> KeptTuning | None:
        """One tuning's job, submitted, waited for (`timeout_s`, else the tuning's) and kept; its facts go in
        `jobs`, its failure in `errors`."""
        t0, key, tuning = time.time(), self.key(share, seed), self.tuning
        job = tuning.submit(share=share, seed=seed, name=f"{tuning.model}@{share}s{seed}")
        tuning.say(f"tuning at {share} %, seed {seed}: job {job.job_id}, {tuning.budget}")
        try:
            final = job.wait(timeout_s=tuning.timeout_s if timeout_s is None else timeout_s, poll_s=1.0)
        except TimeoutError as err:
            final = {"state": "timeout", "error": str(err)}
            if tuning.on_timeout:
                tuning.on_timeout(job)
        wall = time.time() - t0
        if final["state"] != JobState.DONE:
            self.errors[f"{share}:{seed}@*"] = f"tuning job {job.job_id} {final['state']}: {final.get('error')}"
            self.jobs[key] = {"job_id": job.job_id, "state": final["state"], "wall_s": round(wall, 1)}
            tuning.say(f"share {share} %, seed {seed}: {self.errors[f'{share}:{seed}@*']}")
            return None
        res, st = job.result(), job.status()
        self.walls.append(wall)
        facts = {"job_id": job.job_id, "state": JobState.DONE.value, "wall_s": round(wall, 1), "trials": res.trials,
                 "reused_trials": sum(t["reused_trials"] for t in st["tasks"]),
                 "errors": sum(t["errors"] for t in st["tasks"]), "time_split_s": res.time_split_s}
        kept = self.kept.keep(KeptTuning(key=key, model=tuning.model, share=share, seed=seed, trials=tuning.trials,
                                         only_tasks=self.only_tasks, target=res.target, job=facts,
                                         tasks=[t.model_dump() for t in res.tasks], module=res.tuned_module_path),
                              res.database_dir)
        self.jobs[key], self.tuned[(share, seed)] = facts, kept
        tuning.say(f"share {share} %, seed {seed}: tuned, {res.trials} trials in {wall:.0f} s "
                   f"(median tuning {statistics.median(self.walls):.0f} s)")
        return kept


def _compile_main(argv=None) -> int:
    """`python -m sharetune.experiments.share_tunings --ir MODEL.json --db DIR --target JSON --out LIB`: the model
    (ir_codec's JSON) compiled with a kept tuning's database (KeptTunings.modules runs it, one a child)."""
    import argparse

    from services.tuner.metaschedule.compile import compile_tuned
    from services.tuner.metaschedule.ir_codec import load_ir, target_from_json

    ap = argparse.ArgumentParser()
    for flag in ("--ir", "--db", "--target", "--out"):
        ap.add_argument(flag, required=True)
    args = ap.parse_args(argv)
    compile_tuned(load_ir(Path(args.ir).read_text()), target_from_json(args.target), args.db, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(_compile_main())
