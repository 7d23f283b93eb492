"""Start one tuner-service worker: `python -m services.tuner --queue plan|tune|costmodel` (the planner, a
tuner client, the cost-model updater; the same image and code, a different queue)."""
from __future__ import annotations

import argparse

from shared import names
from shared.settings import CommonSettings
from services.workers import exec_worker

ROLES = {names.PLAN_QUEUE: "planner", names.TUNE_QUEUE: "tuner", names.COSTMODEL_QUEUE: "updater"}


def main(argv=None) -> None:
    settings = CommonSettings()
    ap = argparse.ArgumentParser(prog="python -m services.tuner")
    ap.add_argument("--queue", required=True, choices=sorted(ROLES), help="the role: plan, tune or costmodel")
    ap.add_argument("--name", default=None, help="worker name (default: planner, tuner or updater)")
    ap.add_argument("--loglevel", default=settings.log_level)
    args = ap.parse_args(argv)
    exec_worker("services.tuner.tasks", args.queue, args.name or ROLES[args.queue], args.loglevel,
                batch_priority=settings.batch_priority)


if __name__ == "__main__":
    main()
