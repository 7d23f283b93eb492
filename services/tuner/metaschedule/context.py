"""A MetaSchedule TuneContext for one task of a shard: replay-trace while the cost model is cold,
evolutionary search once it is trained."""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms


def tune_context(mod, target, task_name: str, cold: bool, population: int, rand_state: int = -1,
                 num_threads: int = 0, valid_sampling: bool = True) -> ms.TuneContext:
    """`valid_sampling`: on CUDA, samples that break the target's limits are rejected before TVM lowers them
    (validity.LimitsCheck first, then TVM's own postprocessors)."""
    space = "post-order-apply"
    if valid_sampling and target.kind.name == "cuda":
        from services.tuner.metaschedule.validity import cuda_postprocs

        space = ms.space_generator.PostOrderApply(postprocs=cuda_postprocs(target))
    return ms.TuneContext(
        mod=mod,
        target=target,
        space_generator=space,
        search_strategy="replay-trace" if cold else ms.search_strategy.EvolutionarySearch(population_size=population),
        task_name=task_name,
        rand_state=rand_state,
        # the search runs on the tuner's host cores, as in stock tune_relax (a share of them when
        # several clients run on one host)
        num_threads=num_threads or "physical",
    )
