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
    matrix_command(sub)
    args = ap.parse_args(argv)
    if args.cmd == "matrix":
        return args.run(args)

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


def matrix_command(sub) -> None:
    """`sharetune matrix MODEL --shares 25,50,100`: tune at each share, serve each tuned model at every
    share, print the tuned-at x served-at table and the recommended share; write JSON + heatmap."""
    m = sub.add_parser("matrix", help="tune at each share, serve at every share: the latency matrix")
    m.add_argument("model", help="zoo name or .onnx file")
    m.add_argument("--shares", default=None, help="percentages, e.g. 10,25,50,100 (CPU: whole cores of this host)")
    m.add_argument("--cores", default=None, help="CPU only, instead of --shares: core counts, e.g. 1,2")
    m.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    m.add_argument("--trials", type=int, default=32, help="trial budget of each share's tuning job")
    m.add_argument("--per-iter", type=int, default=16)
    m.add_argument("--tasks", type=int, default=None, help="tune only the model's k heaviest tasks")
    m.add_argument("--gpu-index", type=int, default=0)
    m.add_argument("--rounds", type=int, default=10, help="timing rounds per cell (median)")
    m.add_argument("--work-dir", default="runs/matrix")
    m.add_argument("--out", default=None, help="JSON path (default WORK_DIR/share_matrix.json; PNG beside it)")

    def run(args) -> int:
        from pathlib import Path

        from shared.errors import SharetuneError
        from sharetune.matrix import matrix
        from sharetune.share_matrix import shares_from_cores

        try:
            if (args.shares is None) == (args.cores is None):
                raise SharetuneError("give either --shares (percent) or --cores (CPU core counts)")
            if args.cores is not None:
                if args.device != "cpu":
                    raise SharetuneError("--cores is for --device cpu; give GPU shares with --shares")
                shares = shares_from_cores(args.cores, os.cpu_count() or 1)
            else:
                shares = args.shares
            out = Path(args.out or Path(args.work_dir) / "share_matrix.json")
            report = matrix(args.model, shares, device=args.device, trials=args.trials, trials_per_iter=args.per_iter,
                            tasks=args.tasks, gpu_index=args.gpu_index, rounds=args.rounds, work_dir=args.work_dir,
                            redis_url=os.environ.get("REDIS_URL"), out_json=out, out_png=out.with_suffix(".png"))
        except SharetuneError as err:
            print(f"sharetune: {err}", file=sys.stderr)
            return 2
        print(report.table())
        png = out.with_suffix(".png")
        print(f"wrote {out}" + (f" and {png}" if png.exists() else " (no heatmap: matplotlib is not installed)"))
        return 0 if report.complete else 1

    m.set_defaults(run=run)


if __name__ == "__main__":
    sys.exit(main())
