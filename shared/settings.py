"""Configuration through environment variables (pydantic-settings), one class per role. Every SHARETUNE_*
variable is a field here, and nowhere else is one read (tests/test_settings_boundary.py checks): each process
builds its settings once, in its entry point, and passes them down. Every variable is listed in
docs/operations.md's configuration table (tests/test_compose.py checks)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared import hostcores, timeouts
from shared.lanes import Host, LiveLanePolicy


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHARETUNE_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0", validation_alias=AliasChoices("REDIS_URL", "SHARETUNE_REDIS_URL")
    )
    work_dir: Path = Path("runs")  # tuned modules, exported databases, logs
    log_level: str = "INFO"
    # how long a service's Redis operation (and a message it sends) waits for a Redis that is away before it
    # gives up; work that gives up is not failed but left to its lease, and sent again once Redis is back
    redis_outage_s: float = Field(default=600.0, ge=1.0)
    # the CPU priority of every worker that is not a lane (builders and their pools, tuner clients, planner,
    # updater): "idle" (Linux's SCHED_IDLE: they run on the CPU the lanes leave; "low" where the OS has none),
    # "low" (nice 19) or "normal". A lane launches each kernel it times from the CPU: preempted by a build, it
    # counts the wait as the kernel's time (docs/benchmarks.md, "Timing on a busy host")
    batch_priority: Literal["idle", "low", "normal"] = "idle"

    def given(self, name: str) -> Any:
        """The field's value where the environment (or the caller) gave it, else None: for a setting whose
        default is decided where it is used."""
        return getattr(self, name) if name in self.model_fields_set else None


class ApiSettings(CommonSettings):
    # bearer token every API request must carry (Authorization: Bearer <token>); required to serve on an
    # address other than loopback
    api_token: str = ""


class HostSettings(CommonSettings):
    """What a process that names or places lanes on this host reads: the host's node name and its core claims."""

    # CPU lane names and claims are per node: hosts that give the same node name pool lanes of equal share
    node: str = "local"
    # a lane's cores are claimed on its host (shared.hostcores): taken by another live process, the lane is
    # refused ("refuse") or runs and says so ("warn"); the claims live in this directory, shared by every stack
    core_overlap: Literal["refuse", "warn"] = "refuse"
    core_lock_dir: str = hostcores.DEFAULT_LOCK_DIR

    def host(self) -> Host:
        """This host, under its node name (what a lane named by its cores alone is named for)."""
        return Host.this(self.node)


class LaneSettings(HostSettings):
    """One measurer lane: its queue name says what it is (measure.cpu.<node>.p50.c0-1, measure.<gpu8>.p25;
    shared.lanes). `python -m services.measurer` reads these too, to claim a lane or start a builder."""

    lane: str = "measure.cpu.c0"  # set by `python -m services.measurer` (given, or claimed from a pool); cores
    # alone (measure.cpu.c0) name a lane of this host
    gpu_uuid: str | None = None  # full UUID of the lane's GPU (GPU lanes only)
    lane_share: int | None = None  # GPU replicas claim one of 100 // share lanes at this MPS percentage
    lane_cores: int | None = None  # CPU replicas claim one group of this many of the host's cores
    lane_claim: str | None = None  # the claim key this lane holds (set by python -m services.measurer)
    warmup: bool = True  # build a trivial kernel at start, so the first candidate pays nothing
    build_workers: int = 0  # 0: build in the lane process; N: a warm pool of N build processes beside it
    # CPU lanes build and time each candidate in a warm child process, so a candidate that segfaults,
    # aborts or hangs kills only that child (None: on for CPU lanes, off for GPU lanes, whose CUDA
    # context and MPS share live in the lane process)
    sandbox: bool | None = None
    max_crashes: int = 2  # a candidate that killed (or hung) its process this often is quarantined
    sandbox_recycle: int = 2000  # candidates before the sandbox child is replaced (leaked JIT modules)
    # GPU lanes: past a candidate's build wait and run timeout plus this, its kernel is taken as hung
    watchdog_margin_s: float = timeouts.WATCHDOG_MARGIN_S
    # TEST ONLY, off by default: a candidate whose function name starts with "sharetune_test_segv_build"
    # kills its build with SIGSEGV, so tests can inject a build crash that no real TVM input gives on cue
    test_fault_hooks: bool = False
    builder_family: str | None = None  # set: this process is a builder of that family, not a lane
    # the family `python -m services.measurer` builds for when it is given no lane and no --builder
    builder: str | None = None
    # builders (and a lane's build pool) run with no GPU visible and a private MPS pipe directory, so they never
    # open a CUDA context
    builder_hide_gpus: bool = True
    # "kernel": CUDA builds through the kernel-only NVRTC compile (services/measurer/metaschedule/cuda_compile.py);
    # "tvm": TVM's own path
    cuda_compile: Literal["kernel", "tvm"] = "kernel"
    # a kernel-path CUDA compile stops past this many CPU seconds and the build fails with an error that says so
    # (0: no limit). Of the panel's 1,628 stock records on the H200, the 30 whose compile took over 4 s are no
    # task's best, the closest 1.35x of it, and 8 % of the build CPU (docs/benchmarks.md, "The build tail")
    cuda_compile_cpu_limit_s: float = Field(4.0, ge=0)
    # a CUDA source over this many KB is not compiled, and the build fails with an error that says so (0: no
    # limit): such sources are deep unrolls of large tiles, 2.9 % of the panel's 1,628 stock records, none within
    # 1.35x of its task's best, 20 % of the build CPU left after the CPU limit (docs/benchmarks.md, "The build tail")
    cuda_compile_source_limit_kb: float = Field(300.0, ge=0)
    # MiB of compiled CUDA binaries a process keeps by source (0: none): ~12 % of a job's fully timed builds on the
    # H200 lowered to a source the job had built already; a process sees only the candidates it builds itself
    # (docs/benchmarks.md, "Duplicate sources")
    cuda_compile_cache_mb: float = Field(64.0, ge=0)
    # where every build process of a host keeps compiled CUDA binaries by source, shared ("": a folder under the
    # system's temporary directory, one per user), and how many MiB (0: no shared cache). The per-process cache
    # above meets ~0.4 % of the builds' CPU in duplicates with 16 builders; one shared by the host's processes can
    # meet the 5 % that duplicate sources cost (docs/benchmarks.md, "Duplicate sources")
    cuda_compile_cache_dir: str = ""
    cuda_compile_cache_disk_mb: float = Field(512.0, ge=0)

    @field_validator("cuda_compile", mode="before")
    @classmethod
    def _compile_mode(cls, value: Any) -> Any:
        return (value.strip().lower() or "kernel") if isinstance(value, str) else value


def physical_cores() -> int:
    """The host's physical cores (what the search's threads and the stack's tuner count are sized by)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


class AgentSettings(HostSettings):
    """A node agent (python -m services.measurer.agent): what it runs on its host."""

    agent_lanes: str = "cpu"  # cpu (a lane per core), lane queue names, or a GPU share spec (4x25, 2x50)
    builders: int = Field(0, ge=0)  # build workers per family the lanes build for (0: lanes build for themselves)
    builder_cores: str | None = None  # cores the builders are pinned to, e.g. 16-31
    # a GPU lane's build pool; not given: an equal part of the host's cores (services.measurer.agent.gpu_build_workers)
    build_workers: int = Field(0, ge=0)


class BrokerSettings(CommonSettings):
    """The embedded Redis (python -m services.broker.server, a local stack's)."""

    # its maxmemory, in Redis's syntax (4gb, 512mb, bytes); None: a quarter of the host's memory
    redis_maxmemory: str | None = None


class StackSettings(AgentSettings, BrokerSettings):
    """A local stack (`sharetune up`'s supervisor, the demo, the share matrix): its node agent's and its embedded
    Redis's, and what it gives the clients it starts."""

    # threads of each tuner client's search (TunerSettings.search_threads); not given: the stack splits the
    # host's physical cores between its clients
    search_threads: int = 0
    join_url: str | None = None  # `up --join`'s URL, handed to its supervisor here (argv would show it in ps)
    # the share matrix's stack: cores the GPU lanes of one share split for their build pools (None: the host's)
    matrix_cores: int | None = None


class CliSettings(StackSettings, ApiSettings):
    """The `sharetune` command line: its local stacks', its API's, and the work dir of the stack it talks to."""

    work_dir: Path = Path("runs/stack")  # where `sharetune up` recorded the stack's REDIS_URL


class FaultFiguresSettings(CommonSettings):
    """The fault tests' figures for bench/faults.py (sharetune.testing.faults.record_row)."""

    faults_out: str | None = None  # the JSON-lines file they are appended to (None: not written)


class LaneWaitSettings(CommonSettings):
    """The live-lane policy's timeouts (shared.lanes.LiveLanePolicy): client, planner and tuner use these."""

    lane_wait_s: float = 120.0  # the planner parks a job this long for a lane of its share, then fails it
    lane_recheck_s: float = 3.0  # how often a parked job is looked at again
    lane_give_up_s: float = 60.0  # mid-job, how long the tuner waits for a lane of the job's share to come back

    def live_lane_policy(self) -> LiveLanePolicy:
        return LiveLanePolicy(park_s=self.lane_wait_s, recheck_s=self.lane_recheck_s, give_up_s=self.lane_give_up_s)


def _switch_mode(value: Any, on: str) -> Any:
    """A setting with named modes that also takes a switch: 1/true/on mean `on`, 0/false/empty `off`."""
    if isinstance(value, bool):
        return on if value else "off"
    if isinstance(value, str):
        value = value.strip().lower()
        return {"1": on, "true": on, "on": on, "0": "off", "false": "off", "": "off"}.get(value, value)
    return value


class TunerSettings(LaneWaitSettings):
    """A tuner-service worker (planner, tuner client, updater's process): its search, and the live-lane policy."""

    batch_grace_s: float = timeouts.BATCH_GRACE_S  # extra time a started batch gets before its candidates count as lost
    warm_kinds: str = "llvm"  # target kinds whose tensor intrinsics a tuner loads before taking work
    # threads of one client's search (evolutionary search, feature extraction); 0: the host's physical
    # cores. Several clients on one host should split the cores between them.
    search_threads: int = 0
    # with fewer clients than shards (of one job, or of several jobs at once), a client hands its shard back
    # after this long and takes a waiting one (the handed-back one resumes from the store): a job submitted
    # while every client is busy starts within about this long
    shard_quantum_s: float = Field(30.0, gt=0)
    # sample the design space (no evolution) while the central cost model is untrained: evolving
    # against random predictions costs most of the search time and buys nothing
    cold_start: bool = True
    # evolutionary search's population; 0: twice the round's batch (trials_per_iter), 64 to 512
    search_population: int = Field(0, ge=0)
    # an evolutionary CUDA round's generations breed twice their population in mutants and replay and score half
    # the population's size, the ones a linear model of their decisions (fit on what the round scored) ranks
    # best (services/tuner/metaschedule/evolution.py): ~27 % less search CPU a candidate on the CPU, proposals
    # judged as good (docs/time_to_quality.md); on an H100 it lost (ViT 169 against 153 us: one matmul stayed at
    # 46.9 us where the default evolution found 20.1; bench/results/time_to_quality_evolution_screen_h100.json)
    evolution_screen: bool = False
    # the search leaves TVM's VerifyGPUCode to the builders, which run its analysis with its limits on the module
    # they lower anyway (services/measurer/metaschedule/gpu_limits.py), once its first proposals passed it
    # (sampling.ProposalCheck): a CUDA round's proposals are not lowered a second time in the tuner (8-22 ms
    # each); one over a limit fails its build with an error saying so. 0: the search checks its proposals itself
    # (a job whose builders predate the check should)
    verify_in_build: bool = True
    # a CUDA design space also holds, for a block that reduces a product over >= 256 elements into <= 512 K
    # outputs, states that split its reduction in 2, 4 or 8 parts across thread blocks, the partial sums added by a
    # second kernel (services/tuner/metaschedule/split_k.py): the panel's heaviest matmuls and convolutions run their
    # best schedules on 76-544 blocks of 47-156 threads at 6-9 fp32 TFLOPS. Off until a GPU A/B
    split_k: bool = False
    # while every task of a client's shard is being measured, search and send up to this many more rounds of a task
    # before its batch lands (from what the search knew when it was sent; none of its in-flight candidates again),
    # so the builders and lanes are not left waiting for the slowest batch; 0: a task waits for its batch
    rounds_ahead: int = Field(0, ge=0, le=2)
    # the floor of a candidate's full timing in ms (MetaSchedule's min_repeat_ms) for every job this tuner
    # runs; None: its lane kind's (100 ms on a CPU, 50 ms a repeat on a shared GPU). Lower on a quiet device
    # to spend less lane time a candidate, higher on a noisy one
    timing_floor_ms: int | None = Field(None, ge=0, le=10_000)
    # a full timing's repeats first at this floor each (ms), kept where they agree within 1 %, else run again at
    # the floor above; None: its lane kind's (10 ms on a GPU; a CPU lane's one repeat has nothing to agree); 0: off
    timing_settle_ms: int | None = Field(None, ge=0, le=10_000)
    # and kept where they disagree but the fastest is slower than the task's best so far
    # (TimingConfig.settle_above_best)
    timing_settle_above_best: bool = True
    # a cold CUDA round draws tile decisions within the target's limits before replaying them
    # (services/tuner/metaschedule/sampling.py), and a sample whose loop nest breaks them is rejected before TVM
    # lowers it to check (validity.py): the same schedules pass, each rejection costs far less
    valid_sampling: bool = True
    # a cold CUDA round on a store whose central cost model is trained (on other workloads' records) draws this
    # many times its candidates within the limits and measures the model's best, a quarter of them at random from
    # the rest (services/tuner/metaschedule/sampling.py ValidReplay); 1: every round drawn at random
    first_round_pool: int = Field(3, ge=1, le=16)
    # a job whose first rounds that model ranks (decided once a job, by its first client: the model trained for
    # the job's target family when the job starts, first_round_pool > 1, a CUDA job) measures this share of an
    # even first round, 8 at least (allocation.ranked_first_round); the trials left go to evolutionary rounds.
    # Offline on stock's panel records, a ranked round lands where a random one about twice its size does. 1: off
    ranked_first_round_share: float = Field(0.5, gt=0, le=1)
    # a lane that times a candidate fully also runs its task's default-scheduled module on the same inputs and
    # answers a candidate whose output differs with a "wrong result" error: MetaSchedule times kernels without
    # checking what they compute, and a schedule TVM lowers wrongly won its task (docs/time_to_quality.md, 2026-12-07)
    check_outputs: bool = True
    # `matmul`: a CUDA design space also holds, for a matmul (an einsum whose operands are read at plain indices)
    # with an awkward extent (above 16, odd or twice odd: ViT's 197 tokens), the block padded to a multiple of 16,
    # which MultiLevelTiling's exact divisors can tile (services/tuner/metaschedule/padding.py); the unpadded
    # spaces stay. The default: on an H100 it served ViT-S tuned cold at 384 trials in 157 us against 226 us
    # without it (two runs each, docs/time_to_quality.md). `all`: also every convolution whose output has an
    # awkward extent (wav2vec 2.0's 799 columns) computed over the padded extent and sliced, in the graph the job
    # tunes and compiles (conv_padding.py; on an H100 no faster on wav2vec2-conv). 1/true mean `all`, 0/false `off`
    pad_awkward: Literal["off", "matmul", "all"] = "matmul"
    # a layer norm over the channel axis imported as transpose, last-axis layer norm, transpose (wav2vec 2.0's
    # feature encoder) is tuned and compiled as one layer norm over that axis, the activation after it in its kernel
    # (services/tuner/metaschedule/norm_folding.py: 12 tasks of wav2vec2-conv become 6, the same output; on an H100
    # its norm kernels 27.6-27.9 us a model instead of 35.2-37.0 in three paired runs, docs/time_to_quality.md)
    fold_norm_transposes: bool = True
    # a function whose reductions run over a non-innermost axis (a layer norm over the channels, as folding makes
    # wav2vec 2.0's) also gets (`on`), or gets only (`wide`), a CUDA design space that computes it as one kernel, a
    # warp reading neighbouring elements (services/tuner/metaschedule/column_reduction.py). `wide`: on an H100 its
    # norms 5.6-7.6 us against 11.5-17.1 off, wav2vec2-conv served at 0.77-0.79x stock against 0.84-0.95x, the same
    # output, in two paired runs (docs/time_to_quality.md, 2026-12-07). 1/true mean `on`, 0/false `off`
    column_reductions: Literal["off", "on", "wide"] = "wide"
    # what the task gradient's forward term (best / rounds) is worth for a task whose last three rounds gained
    # nothing (services/tuner/allocation.py gradient): 1 is MetaSchedule's rule, under which a 12 us kernel that
    # stopped improving kept a client searching it while a 31 us one still improved at the budget's end
    # (wav2vec2-conv, docs/time_to_quality.md); below 1 such a task yields to the ones still improving
    stalled_task_weight: float = Field(1.0, gt=0, le=1)
    # how many rounds without a gain make a task stalled (its first round counts): with 3 (MetaSchedule's window)
    # a task is stalled at its fifth round at the earliest, which a heavy task of a 384-trial job never reaches
    # (wav2vec2-conv's conv1d1: three rounds, flat after its first); 1: stalled once a round gains nothing
    stalled_task_rounds: int = Field(3, ge=1, le=8)
    # a later round of a task the picker lets run below the other clients' top task gets that share of a full
    # round (its priority / the top's, 8 at least; services/tuner/allocation.py Steering.round_size): clients run
    # rounds at once, and a task a quarter as promising as the top one otherwise takes as many trials; on an H100
    # one pair within the spread of default runs (bench/results/time_to_quality_prorata_rounds_h100.json): off
    prorata_rounds: bool = False
    # a task's forward term in the gradient is weighed by how close its search has come to its default schedule
    # while the default is the faster ((default - floor) / (searched best - floor); services/tuner/allocation.py
    # default_reach): efficientnet-mbconv's excite GEMV and regnety-stage's light convolutions took 29-170 trials of
    # 384-trial jobs without ever beating their defaults; off until a GPU run shows it
    default_reach: bool = False
    # the task gradient's forward term (best / rounds) counts only what lies above the lanes' launch floor (a
    # trivial kernel's time, measured once per target; services/tuner/metaschedule/defaults.py launch_floor): a
    # task at the floor has nothing left to gain (on an H100 efficientnet-mbconv's `mean`, 2.85 us untuned, took 98
    # of a 384-trial job for 0.05 us while its 1x1 convolution kept a random first round); on an H200 it gave the
    # heavy tasks those trials and a lower final latency on efficientnet-mbconv and regnety-stage
    # (bench/results/time_to_quality_latency_floor_h200.json)
    latency_floor: bool = True
    # with the floor on, the first rounds' sizes count each task's default time above the floor too
    # (services/tuner/metaschedule/job_wide.py FirstRounds): a task whose default is a couple of us over the floor
    # gets a light task's first round of 8 where it got the even share of ~42; on an H100 the trials went to the
    # heavy convolutions and efficientnet-mbconv's final latency fell to 37.0 us against 38.99-42.27 in the three
    # runs without it (bench/results/time_to_quality_floor_first_rounds_h100.json)
    floor_first_rounds: bool = True
    # a task's first round starts with the best records of the nearest stored workloads of its operator kind,
    # their decisions replayed in its own design spaces (services/tuner/metaschedule/seeds.py)
    warm_seeds: bool = True
    # with warm seeds on, a task whose first round found no seed (drawn before a sibling of its kind had a record)
    # looks again for its first round after that one landed (seeds.SeedSource.due); off until a GPU A/B
    late_seeds: bool = False
    # while several jobs run, a job with more than an equal share (fair_measure) sends its rounds behind the
    # others' (a broker priority, services/tuner/allocation.py round_priority); nothing is held back
    fair_rounds: bool = True
    # several jobs at once: a client whose job is over an equal share (fair_measure) hands its shard, after its
    # quantum, to a job under one that holds no more clients (services/tuner/allocation.py lagging); off: in its
    # one four-job run on an H100 (then counted in flight) the shares spread further (docs/benchmarks.md)
    fair_clients: bool = False
    # what the jobs' shares are counted in: "measured", the trials each has had measured and recorded, halved every
    # 60 s (store.measured_by_job: its recent share of the measurements, which only being measured raises);
    # "in_flight", its trials claimed and not yet recorded, which a job with more tasks out at once has more of and
    # its rounds' waiting behind others' keeps up, so a job sent behind stayed behind (four jobs on an H100 with 8
    # clients: 13 % of the measurements for one)
    fair_measure: Literal["measured", "in_flight"] = "measured"

    @field_validator("pad_awkward", mode="before")
    @classmethod
    def _pad_mode(cls, value: Any) -> Any:
        return _switch_mode(value, on="all")

    @field_validator("column_reductions", mode="before")
    @classmethod
    def _column_mode(cls, value: Any) -> Any:
        return _switch_mode(value, on="on")

    def population(self, trials_per_iter: int) -> int:
        """Evolutionary search's population for a job measuring `trials_per_iter` a round: the setting, else
        twice that, 64 to 512 (MetaSchedule's). A round's cost is mostly its population: each member not
        taken from the measured best is a fresh random sample (~0.2 s of CPU for a CUDA conv, most samples
        failing the GPU checks), then mutated 4 times. Twice the batch leaves the cost model half to
        reject; 512 for a batch of 64 cost 2.6x the CPU of 128 on ResNet-18's convs."""
        if self.search_population:
            return max(16, self.search_population)
        return max(64, min(512, 2 * trials_per_iter))


class UpdaterSettings(CommonSettings):
    warmup_rows: int = 32  # fewer rows than this: no snapshot, the tuner samples at random (as XGBModel)
    boost_rounds: int = 100
    train_window: int = Field(1536, ge=1)  # newest rows a model is trained on (its cost stays bounded)
    train_best_per_group: int = Field(64, ge=0)  # each workload's fastest rows kept, however old
    train_best_rows: int = Field(512, ge=0)  # of which at most this many, of the window's workloads, are trained on
    # rows kept in the store (the newest; never fewer than the window): older ones are never trained on again,
    # and each workload's fastest are kept apart (train_best_per_group), so the store stays bounded
    train_keep_rows: int = Field(20_000, ge=1)
    # XGBoost threads. Few: a training set is at most ~2,000 rows (2 threads: ~1.2 s), and the host's cores
    # are the search's and the builders'. With every core, the OpenMP team waits at each tree level for
    # threads the builders preempted: on the H200 host a 37-row training took 26 s, the updater busy 231 s
    # of a 250 s job. 0: the host's cores.
    train_threads: int = Field(2, ge=0)
