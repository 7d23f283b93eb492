"""Step-by-step probe of a GPU lane's start-up on the device machine (prints each step)."""
import faulthandler, os, sys, time
faulthandler.enable()
sys.path.insert(0, os.getcwd())
def step(msg): print(f"[{time.strftime('%X')}] {msg}", flush=True)
step("import tvm"); import tvm
step("import tvm.support.nvcc"); import tvm.support.nvcc
step(f"cuda exist {tvm.cuda(0).exist}")
from services.measurer.metaschedule import evaluate
from services.measurer.metaschedule.build import build
from services.measurer.metaschedule.targets import gpu_target
t = gpu_target(); step(f"target {t}")
from tvm import te
a = te.placeholder((64,), name="a"); b = te.compute((64,), lambda i: a[i] + 1.0, name="b")
f = te.create_prim_func([a, b])
sch = tvm.s_tir.Schedule(f) if hasattr(tvm, "s_tir") and hasattr(tvm.s_tir, "Schedule") else None
step(f"schedule api {sch is not None}")
if sch is not None:
    blk = sch.get_sblock("b") if hasattr(sch, "get_sblock") else sch.get_block("b")
    (i,) = sch.get_loops(blk); bx, tx = sch.split(i, [None, 32]); sch.bind(bx, "blockIdx.x"); sch.bind(tx, "threadIdx.x")
    mod = sch.mod
else:
    mod = tvm.IRModule({"main": f})
for mode in ["nvrtc", "nvcc"]:
    os.environ["TVM_CUDA_COMPILE_MODE"] = mode
    step(f"build {mode}")
    try:
        t0 = time.time(); rt = build(mod, t); step(f"built in {time.time()-t0:.2f}s")
        dev = tvm.cuda(0)
        args = [tvm.runtime.empty((64,), "float32", dev) for _ in range(2)]
        step("time"); r = rt.time_evaluator(rt.entry_name, dev, number=3)(*args); step(f"ok {r.mean}")
    except Exception as e:
        step(f"failed: {type(e).__name__}: {str(e)[:500]}")
step("warm_up"); print(evaluate.warm_up(t))
step("done")
