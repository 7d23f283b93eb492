"""A MetaSchedule TuneContext for one task of a shard: design-space sampling while the cost model is cold,
evolutionary search once it is trained."""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from shared.settings import physical_cores
from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics


def tune_context(mod, target, task_name: str, cold: bool, population: int, rand_state: int = -1,
                 num_threads: int = 0, valid_sampling: bool = True, first_round_pool: int = 1,
                 ranking_model=None, pad_awkward: str = "off", column_reductions: str = "off",
                 evolution_screen: bool = False, verify_in_build: bool = False,
                 split_k: bool = False) -> ms.TuneContext:
    """`valid_sampling`: on CUDA, a cold round draws tile decisions within the target's limits before it replays
    them (sampling.ValidReplay), an evolutionary round mutates them within those limits (evolution.ValidEvolution),
    and samples that break the limits are rejected before TVM lowers them (validity.GPUPrecheck first among the
    postprocessors). `first_round_pool`: a cold CUDA round, once `ranking_model` (the central cost model) is trained,
    draws that many times its candidates and proposes the model's best. `pad_awkward` (off, matmul, all): a CUDA
    design space also holds, for a matmul (or a convolution the graph left awkward: conv_padding) with an awkward
    extent (ViT's 197 tokens), the block padded to tile (padding). A CUDA design space leaves out the blocks whose
    output nothing reads (dead_blocks). `column_reductions`: a function whose reductions run over a non-innermost
    axis (a channel-axis layer norm) also gets (`on`), or gets only (`wide`), a state that computes it as one
    coalesced kernel (column_reduction). `evolution_screen`: an evolutionary CUDA round replays and scores only the
    mutants a linear model of their decisions ranks best. `verify_in_build`: a CUDA round leaves TVM's
    VerifyGPUCode on its proposals to the builders (sampling.deferred_check). `split_k`: a CUDA design space also
    holds, for a long reduction into few outputs, states that split it across thread blocks (split_k)."""
    load_tensor_intrinsics(target.kind.name)  # else TuneContext imports every backend's (idempotent)
    space = "post-order-apply"
    cuda = valid_sampling and target.kind.name == "cuda"
    if cuda:
        from services.tuner.metaschedule.dead_blocks import InlineDeadBlocks
        from services.tuner.metaschedule.padding import FinishPadding, PadAwkwardEinsum
        from services.tuner.metaschedule.validity import cuda_postprocs, rule_kind

        rules = [InlineDeadBlocks(), *ms.schedule_rule.ScheduleRule.create(rule_kind(target))]
        if split_k:
            from services.tuner.metaschedule.split_k import with_split_k

            rules = with_split_k(rules)
        if pad_awkward != "off":
            rules = [PadAwkwardEinsum(convolutions=pad_awkward == "all"), *rules, FinishPadding()]
        if column_reductions != "off":
            from services.tuner.metaschedule.column_reduction import ColumnReduction

            rules = [ColumnReduction(column_reductions), *rules]
        space = ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=cuda_postprocs(target))
    if not cold and cuda:
        from services.tuner.metaschedule.evolution import ValidEvolution

        # every member it scores is within the limits, so half the population scores about as many valid
        # schedules as EvolutionarySearch's whole one (docs/time_to_quality.md has both measured)
        strategy = ValidEvolution(seed=rand_state, threads=num_threads or physical_cores(),
                                  population=max(16, population // 2), screen=evolution_screen,
                                  verify_in_build=verify_in_build)
    elif not cold:
        strategy = ms.search_strategy.EvolutionarySearch(population_size=population)
    elif cuda:
        from services.tuner.metaschedule.sampling import ValidReplay

        strategy = ValidReplay(seed=rand_state, threads=num_threads or physical_cores(), pool=first_round_pool,
                               model=ranking_model, verify_in_build=verify_in_build)
    else:
        strategy = "replay-trace"
    # the search runs on the tuner's host cores, as in stock tune_relax (a share of them when several clients run
    # on one host)
    return ms.TuneContext(mod=mod, target=target, space_generator=space, search_strategy=strategy,
                          task_name=task_name, rand_state=rand_state, num_threads=num_threads or "physical")
