"""A node's builder workers: stateless, one build at a time each, serving the target families its lanes
build for (read from the live lanes' targets unless named), pinned to the cores given. Started through the
agent's ProcessSupervisor, which starts a dead one again."""
from __future__ import annotations

import functools
import subprocess
import sys
import time
from dataclasses import dataclass

from shared import lanes as lane_kinds
from shared import store
from services.measurer.agent.processes import NodeConfig, ProcessSupervisor


@dataclass(frozen=True)
class BuilderSpec:
    """`count` build workers per family (0: the lanes build for themselves), pinned to `cores` (e.g.
    "16-31"), for `families` (None: those of the agent's live lanes)."""

    count: int = 0
    cores: str | None = None
    families: list[str] | None = None


class BuilderPool:
    """`families_by_name`: each builder process's name -> the family it builds for."""

    def __init__(self, config: NodeConfig, processes: ProcessSupervisor, spec: BuilderSpec, lanes: list[str]):
        self.config, self.processes, self.spec, self.lanes = config, processes, spec, lanes
        self.families_by_name: dict[str, str] = {}
        processes.on_give_up.append(lambda name: self.families_by_name.pop(name, None))

    def owns(self, name: str) -> bool:
        return name in self.families_by_name

    def start_builder(self, family: str, instance: int) -> subprocess.Popen:
        name = f"builder-{family}-{instance}"
        args = [sys.executable, "-m", "services.measurer", "--builder", family, "--loglevel", self.config.log_level]
        if self.spec.cores:
            args += ["--cores", self.spec.cores]
        self.families_by_name[name] = family
        self.processes.restartable[name] = functools.partial(self.start_builder, family, instance)
        return self.processes.spawn(name, args)

    def start(self, wait_s: float = 300.0) -> list[str]:
        """`count` workers for each family the lanes build for (or the families named); returns the families."""
        families = self.spec.families
        if families is None:
            r = store.connect(self.config.redis_url)
            families = sorted({lane_kinds.target_family(l.target) for l in store.live_lanes(r) if l.queue in self.lanes})
        started = []
        for family in families:
            for i in range(self.spec.count):
                self.start_builder(family, i)
                started.append(family)
        if wait_s and started:
            self.wait(families, self.spec.count, wait_s)
        return families

    def wait(self, families: list[str], count: int, timeout_s: float) -> None:
        r = store.connect(self.config.redis_url)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            live = store.live_builders(r)
            if all(sum(b.family == f for b in live) >= count for f in families):
                return
            dead = [n for n in self.families_by_name if self.processes.exited(n)]
            if dead:
                raise RuntimeError(f"builder {dead[0]} exited at start (see {self.config.log_file(dead[0])})")
            time.sleep(0.3)
        raise TimeoutError(f"builders of {families} did not come up in {timeout_s} s")
