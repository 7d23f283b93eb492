"""A warm child process that builds and times candidates for its lane, so a candidate that segfaults,
aborts or hangs takes down only this child, never the lane.

The child is spawned once (TVM imported, a trivial kernel built) and serves candidates one at a time
over a pipe, as JSON text. When it dies or overruns a candidate's timeout, the lane gets that candidate
back as an error naming the signal or the timeout, and the next candidate gets a fresh child."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

from services.measurer.metaschedule.cuda_compile import CompileOptions
from shared.messages import Candidate, ErrorKind, MeasureResult, TimingConfig

TEST_SEGV_BUILD = "sharetune_test_segv_build"  # see LaneSettings.test_fault_hooks
READY_TIMEOUT_S = 600.0  # import tvm + a warm-up build on a loaded 2-core host


def _serve(conn, target_json: str, warmup: bool, test_hooks: bool, compile_options: CompileOptions = CompileOptions()) -> None:
    """The child's loop: (candidate JSON, timing JSON) in, MeasureResult JSON out."""
    from services.measurer.metaschedule.candidate_codec import load_ir
    from services.measurer.metaschedule import cuda_compile, evaluate
    from services.measurer.metaschedule.targets import target_from_json

    cuda_compile.configure(compile_options)
    targets = {target_json: target_from_json(target_json)}
    if warmup:
        evaluate.warm_up(targets[target_json])
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the lane is gone
            return
        cand, timing = Candidate.model_validate_json(msg[0]), TimingConfig.model_validate_json(msg[1])
        if msg[2] not in targets:
            targets[msg[2]] = target_from_json(msg[2])
        target = targets[msg[2]]
        if test_hooks and _test_segv_build(cand.mod, load_ir):
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            res = evaluate.measure(cand, target, timing)  # build and run errors already come back as data
        except Exception as err:  # noqa: BLE001 - anything else too: only a signal or a hang may end the child
            res = MeasureResult(candidate_id=cand.candidate_id, error_kind=ErrorKind.BUILD,
                                error=f"build failed: {type(err).__name__}: {err}"[:2000])
        conn.send(res.model_dump_json())


def _test_segv_build(packed_mod: str, load_ir) -> bool:
    try:
        return any(str(gv.name_hint).startswith(TEST_SEGV_BUILD) for gv in load_ir(packed_mod).functions)
    except Exception:  # noqa: BLE001 - not a module: the build reports it
        return False


def _signal_name(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Sandbox:
    def __init__(self, target_json: str, warmup: bool = True, recycle_after: int = 2000, test_hooks: bool = False,
                 compile_options: CompileOptions = CompileOptions()):
        self.target_json, self.warmup, self.test_hooks = target_json, warmup, test_hooks
        self.compile_options = compile_options
        self.recycle_after = recycle_after
        self._ctx = multiprocessing.get_context("spawn")  # a fork of a process with TVM's threads is unsafe
        self.proc = None
        self.conn = None
        self.served = 0
        self.restarts = 0  # children replaced after a crash or a hang

    def start(self) -> float:
        """Spawn the child and wait until it is warm; returns the seconds it took."""
        t0 = time.perf_counter()
        parent, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_serve, name="lane-sandbox", daemon=True,
                                      args=(child, self.target_json, self.warmup, self.test_hooks, self.compile_options))
        self.proc.start()
        child.close()
        self.conn, self.served = parent, 0
        if not parent.poll(READY_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"lane sandbox did not warm up in {READY_TIMEOUT_S} s")
        try:
            parent.recv()
        except EOFError:
            code = self.kill()
            raise RuntimeError(f"lane sandbox died while warming up ({_signal_name(code)})") from None
        return time.perf_counter() - t0

    def kill(self) -> int | None:
        """End the child (ours, by its handle) and return its exit code."""
        if self.proc is None:
            return None
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        code = self.proc.exitcode
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None
        return code

    def measure(self, cand: Candidate, timing: TimingConfig, target_json: str | None = None) -> MeasureResult:
        """Build and time one candidate in the child. A crash or a hang comes back as an error result
        with `fault` set; the child is then replaced before the next candidate."""
        if self.proc is None or not self.proc.is_alive() or self.served >= self.recycle_after:
            if self.proc is not None:
                self.kill()
            self.start()
        t0 = time.perf_counter()
        self.conn.send((cand.model_dump_json(), timing.model_dump_json(), target_json or self.target_json))
        self.served += 1
        # one timeout covers build and timing: a warm build takes well under a second (docs/architecture.md, "Builds")
        if self.conn.poll(timing.timeout_s):
            try:
                return MeasureResult.model_validate_json(self.conn.recv())
            except EOFError:
                pass  # the child died: its exit status says how
            code = self.kill()
            self.restarts += 1
            return MeasureResult(candidate_id=cand.candidate_id, fault="crash", error_kind=ErrorKind.CRASH,
                                 run_s=time.perf_counter() - t0,
                                 error=f"candidate killed its process: {_signal_name(code)}")
        self.kill()
        self.restarts += 1
        return MeasureResult(candidate_id=cand.candidate_id, fault="timeout", error_kind=ErrorKind.CRASH,
                             run_s=time.perf_counter() - t0,
                             error=f"candidate timed out: no result in {timing.timeout_s:g} s, its process was killed")

    def close(self) -> None:
        self.kill()
