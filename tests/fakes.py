"""Fakes for unit tests of pure logic: an in-memory stand-in for the few Redis calls the store makes on
records and workloads, a store holding one small workload's records, and the stack supervisor's process and
MPS handles."""
from __future__ import annotations


class MemoryRedis:
    """The Redis calls shared.store makes for workloads and records, in memory."""

    def __init__(self):
        self.kv, self.hashes = {}, {}

    def set(self, key, value, nx=False):
        if nx and key in self.kv:
            return False
        self.kv[key] = value
        return True

    def get(self, key):
        return self.kv.get(key)

    def mget(self, keys):
        return [self.kv.get(k) for k in keys]

    def hset(self, key, field, value):
        self.hashes.setdefault(key, {})[field] = value

    def hvals(self, key):
        return list(self.hashes.get(key, {}).values())


def store_with_records(records):
    """A workload "w" (b = a + 1 over 64 floats, llvm) and one record per (key, split factor, run_secs, timing):
    (the fake Redis, the workload's module)."""
    import tvm
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.ir_codec import dump_ir
    from services.tuner.metaschedule.records import record_json
    from shared import store
    from shared.messages import Record, Workload

    a = te.placeholder((64,), name="A")
    b = te.compute((64,), lambda i: a[i] + 1, name="B")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    target = tvm.target.Target({"kind": "llvm"})
    r = MemoryRedis()
    store.put_workload(r, Workload(wkey="w", name="add", target=str(target), share=100, mod=dump_ir(mod)))
    wl = ms.database.Workload(mod)
    for key, factor, secs, timing in records:
        sch = tvm.s_tir.Schedule(mod)
        sch.split(sch.get_loops(sch.get_sblock("B"))[0], [None, factor])
        trec = ms.database.TuningRecord(sch.trace, wl, secs, target, ms.arg_info.ArgInfo.from_prim_func(mod["main"]))
        store.replace_record(r, Record(candidate_key=key, wkey="w", trace=record_json(trec), run_secs=secs,
                                       target=str(target), args_info=[], share=100, timing=timing))
    return r, mod


class FakeProc:
    """A started process as the stack's supervisor sees it (poll, wait, pid), without one."""

    def __init__(self, code=None, pid=4242):
        self.returncode, self.pid = code, pid

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


class FakeMps:
    """The stack's MPS daemon (ours, started) recording what the supervisor asks of it; `servers` gives its
    server -> client pids list, read when asked."""

    started = True

    def __init__(self, servers=dict):
        self._servers, self.calls = servers, []

    def servers(self):
        return self._servers()

    def stop(self):
        self.calls.append("stop")

    def start(self):
        self.calls.append("start")

    def environment(self):
        return {}


class FakeHost:
    """The host's process table and signal sender (services.measurer.agent.HostProcesses), as given: nothing
    on the host is read or signalled."""

    def __init__(self, table=dict, end=lambda pids, grace_s=3.0: {"terminated": sorted(pids)}):
        self.table, self.end = table, end
