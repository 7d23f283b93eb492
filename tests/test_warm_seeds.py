"""Warm first rounds: the nearest stored workloads of a task's operator kind, their best traces re-fitted to the
task and measured as seeds; a trace that does not apply is skipped."""
from __future__ import annotations

import math

import pytest

from shared import store
from shared.messages import WorkloadShape
from services.tuner.similarity import distance, nearest, op_kind


def _shape(wkey, op="conv2d", params=((1, 3, 16, 16), (8, 3, 3, 3), (1, 8, 16, 16)), dtypes=("float32",) * 3):
    return WorkloadShape(wkey=wkey, op=op, target="t", share=100, params=[list(p) for p in params],
                         dtypes=list(dtypes))


def test_the_operator_kind_is_the_anchor_operator_without_tvms_numbering():
    assert op_kind("fused_conv2d2_add_tir_sigmoid2_multiply2") == op_kind("fused_conv2d_add_relu_1") == "conv2d"
    assert op_kind("fused_matmul4_add") == "matmul" and op_kind("conv1d6") == "conv1d"
    assert op_kind("fused_batch_norm1_relu1") == "batch_norm" and op_kind("layer_norm4") == "layer_norm"


def test_nearest_orders_by_shape_distance_and_leaves_out_what_is_not_comparable():
    task = _shape("new")
    near = _shape("near", params=((1, 3, 16, 16), (16, 3, 3, 3), (1, 16, 16, 16)))
    far = _shape("far", params=((1, 3, 64, 64), (8, 3, 3, 3), (1, 8, 64, 64)))
    other_rank = _shape("rank", params=((1, 3, 16, 16), (8, 3, 3, 3), (8, 16, 16)))
    other_dtype = _shape("dtype", dtypes=("float16",) * 3)
    assert distance(task, near) == pytest.approx(2 * math.log(2))
    assert distance(task, other_rank) == math.inf and distance(task, other_dtype) == math.inf
    got = nearest(task, [far, other_rank, near, other_dtype, _shape("new")], k=3)
    assert [s.wkey for _, s in got] == ["near", "far"]  # its own workload is not a seed of itself


def test_tile_factors_are_refitted_to_the_new_extent():
    from services.tuner.metaschedule.seeds import refit_tile

    assert refit_tile([4, 2, 2, 1], 20) == [5, 2, 2, 1]
    assert refit_tile([1, 8, 1, 4], 20) == [5, 1, 1, 4]
    out = refit_tile([2, 3, 7], 16)
    assert math.prod(out) == 16 and out[-1] == 1


def _conv_and_matmul_tasks():
    import tvm
    from tvm import relax

    from services.tuner.metaschedule.extract import extract

    cpu = tvm.target.Target({"kind": "llvm", "num-cores": 1})

    def one(build):
        bb = relax.BlockBuilder()
        build(bb)
        (task,) = extract(bb.get(), cpu)
        return task

    def conv(hw, cout):
        def build(bb):
            x = relax.Var("x", relax.TensorType((1, 3, hw, hw), "float32"))
            w = relax.Var("w", relax.TensorType((cout, 3, 3, 3), "float32"))
            with bb.function("main", [x, w]):
                with bb.dataflow():
                    out = bb.emit_output(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, w, padding=1))))
                bb.emit_func_output(out)
        return one(build)

    def matmul(bb):
        x = relax.Var("x", relax.TensorType((4, 64), "float32"))
        w = relax.Var("w", relax.TensorType((64, 32), "float32"))
        with bb.function("main", [x, w]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.matmul(x, w))
            bb.emit_func_output(out)

    return cpu, conv(16, 8), conv(20, 16), one(matmul)


def test_a_trace_applies_to_a_nearby_shape_and_one_of_another_operator_is_skipped():
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.seeds import transfer

    cpu, small, large, mm = _conv_and_matmul_tasks()
    src = tune_context(small.mod, cpu, small.name, True, 16, rand_state=1, num_threads=1)
    src.pre_tuning(100, 4, src.generate_design_space(), ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    traces = [c.sch.trace for c in src.generate_measure_candidates()]
    dst = tune_context(large.mod, cpu, large.name, True, 16, rand_state=2, num_threads=1)
    moved = [transfer(tr, dst, dst.generate_design_space()) for tr in traces]
    assert all(m is not None for m in moved)
    for m in moved:  # a schedule of the new workload: its trace replays on it alone
        again = tvm.s_tir.Schedule(large.mod)
        m.sch.trace.apply_to_schedule(again, remove_postproc=False)
    other = tune_context(mm.mod, cpu, mm.name, True, 16, rand_state=1, num_threads=1)
    assert transfer(other.generate_design_space()[0].trace, dst, dst.generate_design_space()) is None  # fits no space


def _conv_relu_job(client, lane_share, conv, example_shape: tuple):
    """A job of one convolution and a ReLU on CPU lanes, 16 trials, run to its end."""
    import torch
    from torch import nn

    class ConvReLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return torch.relu(self.conv(x))

    torch.manual_seed(0)
    job = client.submit(ConvReLU().eval(), example_inputs=(torch.randn(*example_shape),), target="llvm",
                        share=lane_share, trials=16, trials_per_iter=16, seed=0)
    final = job.wait(timeout_s=900)
    assert final["state"] == "done", final
    return job


def test_a_new_job_seeds_its_first_rounds_from_a_nearby_workload(client, lane_share, redis_conn, tuned_tiny):
    """After the tiny model (a 3->8 conv on 16x16), a model whose conv is 3->16 on 20x20 starts from it."""
    from torch import nn

    job = _conv_relu_job(client, lane_share, nn.Conv2d(3, 16, 3, 1, 1), (1, 3, 20, 20))
    own = {t.wkey for t in store.job_tasks(redis_conn, job.job_id)}
    recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    seeded = [r for r in recs if r.seeded_from]
    assert seeded, "no warm seed was measured"
    # from other workloads in the store (the tiny model's conv, or another earlier job's), never its own
    assert all(r.seeded_from and r.seeded_from not in own for r in seeded)
    assert all(r.error is None and r.run_secs for r in seeded)  # re-fitted traces build and run
    assert len(recs) == 16  # seeds are trials of the job's budget, not extra
    split = store.splits(redis_conn, job.job_id)
    assert sum(s.get("seeds_measured", 0) for s in split) == len(seeded)


def test_a_1d_convolution_seeds_its_first_round_from_an_image_convolution(client, lane_share, redis_conn, tuned_tiny):
    """After the tiny model (a 3->8 conv on 16x16), a model of a 3->8 1-D conv over 256 samples (the same positions
    once the image is folded) starts from the image convolution's records."""
    from torch import nn

    job = _conv_relu_job(client, lane_share, nn.Conv1d(3, 8, 3, 1, 1), (1, 3, 256))
    tasks = store.job_tasks(redis_conn, job.job_id)
    conv = [t for t in tasks if "conv1d" in t.name]
    recs = [r for t in conv for r in store.records(redis_conn, t.wkey) if r.job_id == job.job_id]
    seeded = [r for r in recs if r.seeded_from]
    assert seeded, "no folded seed was measured"
    image = {store.workload(redis_conn, r.seeded_from).name for r in seeded}
    assert all("conv2d" in name for name in image), image
    assert all(r.error is None and r.run_secs for r in seeded)


def test_the_settings_turn_both_off(monkeypatch):
    from shared.settings import TunerSettings

    monkeypatch.setenv("SHARETUNE_WARM_SEEDS", "0")
    monkeypatch.setenv("SHARETUNE_VALID_SAMPLING", "false")
    s = TunerSettings()
    assert s.warm_seeds is False and s.valid_sampling is False and s.late_seeds is False
    monkeypatch.setenv("SHARETUNE_LATE_SEEDS", "1")
    assert TunerSettings().late_seeds is True
    monkeypatch.delenv("SHARETUNE_LATE_SEEDS")
    monkeypatch.delenv("SHARETUNE_WARM_SEEDS")
    monkeypatch.delenv("SHARETUNE_VALID_SAMPLING")
    s = TunerSettings()
    assert s.warm_seeds is True and s.valid_sampling is True


def test_a_first_round_evolves_only_on_a_model_that_knows_the_workload(tmp_path):
    """A cost model trained on other networks' operators does not guide a task it has never seen: the task
    samples its first round. It evolves from its first round when the store holds its workload or a near one,
    and after its first round in any case."""
    from services.broker.server import EmbeddedRedis
    from services.tuner.metaschedule.rounds import SearchParts, Shard, ShardLoop
    from services.tuner.metaschedule.seeds import SeedSource
    from shared import names
    from shared.messages import JobTask

    class Trained:
        def trained(self):
            return True

    with EmbeddedRedis(tmp_path / "redis") as srv:
        r = store.connect(srv.url)
        near = _shape("near", params=((1, 3, 16, 16), (12, 3, 3, 3), (1, 12, 16, 16)))  # 2 x log(1.5) away
        far = _shape("far", params=((1, 3, 64, 64), (8, 3, 3, 3), (1, 8, 64, 64)))  # 4 x log(4) away
        r.hset(names.similar_key("llvm", "conv2d"), "far", far.model_dump_json())
        tasks = {name: JobTask(task_id=name, name="fused_conv2d_add", weight=1, wkey=name, flops=1.0)
                 for name in ("new", "again")}
        seeds = SeedSource(r, "llvm", "t", 100, shapes={name: _shape(name) for name in tasks})
        loop = ShardLoop(Shard(r, "job", 0, list(tasks.values()), trials_per_iter=8, max_trials_per_task=64),
                         SearchParts(None, None, None, None, Trained(), None, seeds=seeds))  # the rule alone
        new = loop.tasks[0]
        assert not seeds.knows(tasks["new"]) and not new.may_evolve()  # only a far workload is stored
        r.hset(names.similar_key("llvm", "conv2d"), "near", near.model_dump_json())
        assert seeds.knows(tasks["new"]) and new.may_evolve()
        r.hset(names.records_key("again"), "k", b"{}")  # its own workload measured before (another job)
        assert seeds.knows(tasks["again"])
        r.delete(names.similar_key("llvm", "conv2d"))
        new.launched(1, claimed=1)  # its own first round has been sent
        assert new.may_evolve()


def test_late_seeds_are_due_once_after_a_first_round_without_any():
    """With late seeds a task looks again in its first round after its first one landed, if no seed came before;
    never a third time, never after a look that found some, never for a resumed task, and not without the setting."""
    from services.tuner.metaschedule.seeds import SeedSource

    first_only, late = SeedSource(None, "llvm", "t", 100), SeedSource(None, "llvm", "t", 100, late=True)
    assert first_only.due(False, 0, []) and late.due(False, 0, [])  # every first round
    assert not first_only.due(True, 1, [0])
    assert late.due(True, 1, [0])
    assert not late.due(True, 0, [0])  # a round ahead while its first is still measured
    assert not late.due(True, 1, [3])  # its first round had seeds
    assert not late.due(True, 2, [0, 0])  # it looked twice
    assert not late.due(True, 4, [])  # a resumed task (its first rounds were another process's)


def test_a_task_takes_late_seeds_in_its_second_round(tmp_path):
    """The task's rounds put the seeds the source finds first: none in a first round drawn before a sibling had a
    record, the sibling's in the round after it landed, then no further look."""
    from services.broker.server import EmbeddedRedis
    from services.tuner.metaschedule.rounds import SearchParts, Shard, ShardLoop
    from services.tuner.metaschedule.seeds import SeedSource
    from shared.messages import JobTask

    class Sibling(SeedSource):
        def __init__(self):
            super().__init__(None, "llvm", "t", 100, late=True)
            self.found, self.looked = 0, 0

        def seeded_round(self, ctx, task, records, fresh, room):
            self.looked += 1
            return ["seed"] * self.found + fresh, self.found

    class Trained:
        def trained(self):
            return True

    with EmbeddedRedis(tmp_path / "redis") as srv:
        task = JobTask(task_id="conv", name="conv1d2", weight=1, wkey="conv", flops=1.0)
        seeds = Sibling()
        loop = ShardLoop(Shard(store.connect(srv.url), "job", 0, [task], trials_per_iter=8, max_trials_per_task=64),
                         SearchParts(None, None, None, None, Trained(), None, seeds=seeds))
        t = loop.tasks[0]
        assert t._with_seeds(["a", "b"], 8) == ["a", "b"] and t.seed_looks == [0]  # nothing stored yet
        t.launched(2, claimed=2)
        assert t._with_seeds(["c"], 8) == ["c"] and seeds.looked == 1  # its first round has not landed
        t.landed, seeds.found = 1, 2
        assert t._with_seeds(["d"], 8) == ["seed", "seed", "d"]
        assert t.stats.seeds == t.stats.late_seeds == 2
        assert t._with_seeds(["e"], 8) == ["e"] and seeds.looked == 2


def test_an_isolated_job_is_seeded_only_from_its_own_workloads(tmp_path):
    """An isolated job (a replicate of a search) tunes as on an empty store: a near workload of another job does
    not seed it, nor count as known; one of its own tasks does."""
    from services.broker.server import EmbeddedRedis
    from services.tuner.metaschedule.seeds import SeedSource
    from shared import names
    from shared.messages import JobTask

    with EmbeddedRedis(tmp_path / "redis") as srv:
        r = store.connect(srv.url)
        near = _shape("other-job", params=((1, 3, 16, 16), (12, 3, 3, 3), (1, 12, 16, 16)))
        r.hset(names.similar_key("llvm", "conv2d"), "other-job", near.model_dump_json())
        task = JobTask(task_id="mine", name="fused_conv2d_add", weight=1, wkey="mine", flops=1.0)
        shapes = {"mine": _shape("mine")}
        assert SeedSource(r, "llvm", "t", 100, shapes=shapes).knows(task)
        isolated = SeedSource(r, "llvm", "t", 100, shapes=shapes, within={"mine", "my-other-task"})
        assert not isolated.knows(task) and isolated.stored("conv2d") == []
        own = _shape("my-other-task", params=((1, 3, 16, 16), (12, 3, 3, 3), (1, 12, 16, 16)))
        r.hset(names.similar_key("llvm", "conv2d"), "my-other-task", own.model_dump_json())
        assert isolated.knows(task) and [s.wkey for s in isolated.stored("conv2d")] == ["my-other-task"]


def test_an_isolated_jobs_workload_keys_are_its_own():
    from services.tuner.metaschedule.extract import extract, workload_key
    from services.measurer.metaschedule.targets import cpu_target
    from sharetune.intake import to_relax
    from sharetune.zoo import get

    target = cpu_target(1)
    task = extract(to_relax(*get("tiny").build()).mod, target)[0]
    common = workload_key(task.mod, target, 50)
    assert common == workload_key(task.mod, target, 50, scope=None)  # keys of earlier jobs unchanged
    assert len({common, workload_key(task.mod, target, 50, "job-a"), workload_key(task.mod, target, 50, "job-b")}) == 3


def _cuda_linear(rows: int, target, bias: bool = True):
    """x @ w (+ b) over `rows` tokens (a transformer's dense layer, its bias fused): one CUDA task."""
    from tvm import relax

    from services.tuner.metaschedule.extract import extract

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 384), "float32"))
    w = relax.Var("w", relax.TensorType((384, 384), "float32"))
    b = relax.Var("b", relax.TensorType((384,), "float32"))
    with bb.function("main", [x, w, b] if bias else [x, w]):
        with bb.dataflow():
            out = relax.op.matmul(x, w)
            out = bb.emit_output(relax.op.add(out, b) if bias else out)
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target)
    return task


def _row_tiles(trace) -> list[int]:
    """The first tile decision after any padding: the matmul's rows."""
    return next([int(d) for d in trace.decisions[i]] for i in trace.insts if i.kind.name == "SamplePerfectTile")


def test_an_awkward_matmul_takes_its_seeds_in_its_padded_space():
    """A 128-token matmul's tiles re-fitted to 197 (prime) rows keep no row factor but the outermost, and most
    such seeds break the thread limits; in the padded space's 208 rows they keep their inner factors. Each seed
    is a draw of one of the task's own spaces (evolution breeds from it)."""
    import math

    import tvm
    from tvm.s_tir import meta_schedule as ms

    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.evolution import _signature
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.metaschedule.padding import is_padded
    from services.tuner.metaschedule.seeds import transfer

    load_tensor_intrinsics("cuda")
    cuda = family_target("cuda.sm_90")
    small, awkward = _cuda_linear(128, cuda), _cuda_linear(197, cuda)
    src = tune_context(small.mod, cuda, small.name, True, 16, rand_state=3, num_threads=1, pad_awkward="matmul")
    src.pre_tuning(100, 16, src.generate_design_space(), ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    traces = [c.sch.trace for c in src.generate_measure_candidates()]
    assert traces and not any(is_padded(t) for t in traces)  # 128 rows tile as they are

    def seeds(pad: str):
        dst = tune_context(awkward.mod, cuda, awkward.name, True, 16, rand_state=3, num_threads=1, pad_awkward=pad)
        spaces = dst.generate_design_space()
        return [transfer(t, dst, spaces) for t in traces], {_signature(s.trace.insts) for s in spaces}

    plain, _ = seeds("off")
    padded, signatures = seeds("matmul")
    assert sum(p is not None for p in padded) > sum(p is not None for p in plain)
    kept = 0
    for trace, seed in zip(traces, padded):
        if seed is None:
            continue
        assert _signature(seed.sch.trace.insts) in signatures
        again = tvm.s_tir.Schedule(awkward.mod)  # a schedule of the new workload: its trace replays on it alone
        seed.sch.trace.apply_to_schedule(again, remove_postproc=False)
        assert is_padded(seed.sch.trace)  # the tiles fit neither space exactly: the padded one first
        rows = _row_tiles(seed.sch.trace)
        assert math.prod(rows) == 208
        kept += rows[1:] == _row_tiles(trace)[1:]
    assert kept >= 1
    for seed in plain:
        if seed is not None:
            assert _row_tiles(seed.sch.trace)[1:] == [1, 1, 1, 1]  # 197 is prime: only the outermost factor


def test_a_fused_matmuls_decisions_seed_a_matmul_without_the_fused_bias():
    """The same operator kind with another epilogue: the stored trace names a bias block the new task lacks, so
    replayed as it was it applies nowhere; its decisions fit the new task's own space."""
    from tvm.s_tir import meta_schedule as ms

    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.evolution import _signature
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.metaschedule.seeds import transfer

    load_tensor_intrinsics("cuda")
    cuda = family_target("cuda.sm_90")
    fused, bare = _cuda_linear(128, cuda), _cuda_linear(256, cuda, bias=False)
    src = tune_context(fused.mod, cuda, fused.name, True, 8, rand_state=3, num_threads=1)
    src.pre_tuning(100, 8, src.generate_design_space(), ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    traces = [c.sch.trace for c in src.generate_measure_candidates()]
    dst = tune_context(bare.mod, cuda, bare.name, True, 8, rand_state=3, num_threads=1)
    spaces = dst.generate_design_space()
    seeds = [transfer(t, dst, spaces) for t in traces]
    assert traces and all(s is not None for s in seeds)
    assert {_signature(s.sch.trace.insts) for s in seeds} <= {_signature(s.trace.insts) for s in spaces}


def test_a_convolution_of_more_dimensions_is_near_one_of_fewer_after_its_own_kind():
    from services.tuner.similarity import CROSS_RANK, fold, folded_dims, source_kinds

    task = _shape("audio", op="conv1d", params=((1, 3, 256), (8, 3, 9), (1, 8, 256)))
    image = _shape("image", params=((1, 3, 16, 16), (8, 3, 3, 3), (1, 8, 16, 16)))  # 256 positions, 9 taps
    same_kind = _shape("same", op="conv1d", params=((1, 3, 512), (8, 3, 9), (1, 8, 512)))
    assert source_kinds("conv1d") == ["conv1d", "conv2d", "conv3d"] and source_kinds("matmul") == ["matmul"]
    assert folded_dims("conv1d", "conv2d") == 1 and folded_dims("conv2d", "conv1d") == -1
    assert fold([1, 8, 4, 5, 6], 2, 5) == [1, 8, 120] and fold([8], 1, 4) == [8]
    assert distance(task, image) == pytest.approx(CROSS_RANK)  # equal once folded: the kind's distance alone
    assert distance(image, task) == math.inf  # a 1-D tiling does not say how to split an image
    assert distance(task, same_kind) < CROSS_RANK and [s.wkey for _, s in nearest(task, [image, same_kind])] == [
        "same", "image"]


def test_merged_tilings_keep_the_divisor_nearest_each_factor():
    from services.tuner.metaschedule.seeds import nearest_fit, refit_tile

    assert refit_tile([1, 1, 49, 1], 800) == [800, 1, 1, 1]  # 7 x 7 threads share no factor with 800
    assert nearest_fit([1, 1, 49, 1], 800) == [16, 1, 50, 1]
    assert nearest_fit([4, 2, 16], 256) == [8, 2, 16]  # what divides is kept as it is
    assert math.prod(nearest_fit([3, 5, 7, 11], 1000)) == 1000


def _conv_task(spatial: tuple, channels: int, kernel: int, target):
    """A stride-1 convolution over `spatial` (one to three axes), `channels` in and out: one task."""
    from tvm import relax

    from services.tuner.metaschedule.extract import extract

    conv = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}[len(spatial)]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, *spatial), "float32"))
    w = relax.Var("w", relax.TensorType((channels, channels) + (kernel,) * len(spatial), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(conv(x, w, padding=kernel // 2))
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target)
    return task


def _folded_seeds(source, task, target, seed: int) -> tuple[list, list]:
    """(8 sampled traces of `source`, each transferred to `task` folded by one spatial axis); as they are, none fits."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.seeds import transfer

    src = tune_context(source.mod, target, source.name, True, 8, rand_state=seed, num_threads=1)
    src.pre_tuning(100, 8, src.generate_design_space(), ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    traces = [c.sch.trace for c in src.generate_measure_candidates()]
    dst = tune_context(task.mod, target, task.name, True, 8, rand_state=seed, num_threads=1)
    spaces = dst.generate_design_space()
    assert traces and all(transfer(t, dst, spaces) is None for t in traces)
    return traces, [transfer(t, dst, spaces, fold=1) for t in traces]


def test_an_image_convolutions_decisions_seed_a_1d_convolution():
    """A 2-D convolution's tilings on 28 x 28 (7 x 7 of it in threads) folded onto a 1-D one over 800 positions:
    every seed applies, passes TVM's whole chain (VerifyGPUCode included) and keeps its channel tiles and as many
    threads on the merged axis as the nearest divisor gives."""
    import tvm

    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.metaschedule.sampling import sampled

    load_tensor_intrinsics("cuda")
    cuda = family_target("cuda.sm_90")
    audio = _conv_task((800,), 64, 3, cuda)
    traces, seeds = _folded_seeds(_conv_task((28, 28), 64, 3, cuda), audio, cuda, 3)
    assert all(s is not None for s in seeds)

    def tiles(trace):
        return [[int(x) for x in trace.decisions[i]] for i in sampled(trace) if i.kind.name == "SamplePerfectTile"]

    for trace, seed in zip(traces, seeds):
        again = tvm.s_tir.Schedule(audio.mod)  # a schedule of the new workload: its trace replays on it alone
        seed.sch.trace.apply_to_schedule(again, remove_postproc=False)
        src_tiles, own = tiles(trace), tiles(seed.sch.trace)
        assert own[1] == src_tiles[1] and math.prod(own[2]) == 800  # channels as they were; positions re-fitted
        assert own[2][2] >= max(1, src_tiles[2][2] * src_tiles[3][2] // 2)  # the merged thread level kept


def test_a_video_convolutions_decisions_seed_an_image_convolution_on_the_cpu():
    """The fold is general: a 3-D convolution's depth and height tilings merge into a 2-D one's height (CPU spaces:
    four spatial and two reduction levels), and every seed applies."""
    import tvm

    cpu = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    _, seeds = _folded_seeds(_conv_task((4, 8, 8), 8, 3, cpu), _conv_task((32, 8), 8, 3, cpu), cpu, 1)
    assert all(s is not None for s in seeds)
