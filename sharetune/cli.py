"""`sharetune` command line: demo, submit, status, lanes."""
from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sharetune", description="GPU/CPU autotuning with spatial sharing")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="tune a built-in model on this CPU with an embedded Redis, then stop")
    d.add_argument("--model", default="small_cnn")
    d.add_argument("--trials", type=int, default=40)
    d.add_argument("--per-iter", type=int, default=8)
    d.add_argument("--work-dir", default="runs/demo")
    s = sub.add_parser("submit", help="submit a model (zoo name, .onnx file) to a running stack")
    s.add_argument("model")
    s.add_argument("--target", default="llvm")
    s.add_argument("--share", type=int, default=100)
    s.add_argument("--trials", type=int, default=64)
    s.add_argument("--per-iter", type=int, default=16)
    s.add_argument("--wait", action="store_true")
    up = sub.add_parser("up", help="start the stack as local processes and leave it running")
    up.add_argument("--work-dir", default="runs/stack")
    up.add_argument("--lanes", default=None, help="comma-separated lane queues (default: one CPU lane per core)")
    up.add_argument("--gpu", default=None, help="GPU lane spec on this host's GPUs, e.g. 4x25")
    up.add_argument("--tuners", type=int, default=1)
    down = sub.add_parser("down", help="stop the stack `up` started (by PID)")
    down.add_argument("--work-dir", default="runs/stack")
    st = sub.add_parser("status", help="a job's state and per-task progress")
    st.add_argument("job_id")
    sub.add_parser("lanes", help="live measurer lanes")
    args = ap.parse_args(argv)

    if args.cmd == "demo":
        from sharetune.demo import run_demo

        return run_demo(args.model, args.trials, args.per_iter, args.work_dir)

    if args.cmd == "up":
        from sharetune.stack import Stack, gpu_lanes

        lanes = args.lanes.split(",") if args.lanes else (gpu_lanes(args.gpu) if args.gpu else None)
        stack = Stack(args.work_dir, lanes=lanes, tuners=args.tuners)
        try:
            stack.start()
        except BaseException:
            stack.stop()
            raise
        state = stack.detach()
        print(f"REDIS_URL={state['redis_url']}")
        print(f"lanes: {', '.join(state['lanes'])}; stop with: sharetune down --work-dir {args.work_dir}")
        return 0
    if args.cmd == "down":
        from sharetune.stack import Stack

        print("stopped: " + ", ".join(Stack.stop_detached(args.work_dir)))
        return 0

    from shared.errors import SharetuneError
    from sharetune.client import Client

    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        client = Client(url)
        if args.cmd == "submit":
            job = client.submit(args.model, target=args.target, share=args.share, trials=args.trials,
                                trials_per_iter=args.per_iter)
            print(job.job_id)
            if args.wait:
                print(json.dumps(job.wait(), indent=1))
        elif args.cmd == "status":
            print(json.dumps(client.job(args.job_id).status(), indent=1))
        elif args.cmd == "lanes":
            for lane in client.lanes():
                print(lane.model_dump_json())
    except SharetuneError as err:
        print(f"sharetune: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
