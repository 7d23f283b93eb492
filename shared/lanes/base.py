"""What a lane is, said once: the `LaneKind` interface every kind of lane implements, the `Lane` value,
the host a lane is placed on, and the registry of kinds.

A lane is one unit of spatial share of one device, with its own queue. Its kind knows everything that
differs between devices: the queue name, how a share maps to a placement (cores of a host, an MPS
percentage of a GPU), the target it measures for, how candidates are isolated, which faults take the whole
device, and the environment its process needs. Everything else asks the kind; a new kind of lane is one
module that defines a LaneKind subclass and registers it."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Host:
    """What a lane's placement depends on: the host's core count and its node name (SHARETUNE_NODE)."""

    cores: int
    node: str = "local"

    @classmethod
    def this(cls, node: str) -> "Host":
        """The host this process runs on, under the node name its settings give (HostSettings.node)."""
        return cls(cores=os.cpu_count() or 1, node=node)


@dataclass(frozen=True)
class Lane:
    """One lane: its kind, the share it serves, and where (cores of a node, or a GPU)."""

    kind: str
    share: int  # percent of the device
    cores: tuple[int, ...] = ()
    gpu: str | None = None  # first 8 hex digits of the GPU UUID
    node: str | None = None

    @property
    def queue(self) -> str:
        return kind(self.kind).queue(self)


class LaneKind(ABC):
    """One kind of lane. Subclasses set the class attributes and implement the abstract methods; the
    defaults of the others fit a lane that needs nothing special."""

    name: ClassVar[str]  # as LaneInfo.kind and Lane.kind carry it
    target_kind: ClassVar[str]  # the TVM target kind its lanes build and time for ("llvm", "cuda")
    sandboxed: ClassVar[bool] = False  # default isolation: each candidate in a child process the lane can lose
    mps: ClassVar[bool] = False  # a share below 100 % is an MPS thread percentage (needs an MPS daemon)
    device_uuid: ClassVar[bool] = False  # its process must be given its device's full UUID
    build_pool: ClassVar[bool] = False  # builds take far longer than runs: the lane builds in a pool of the host's cores
    runs_on_host_cores: ClassVar[bool] = False  # a model tuned on these lanes runs on a host's cores (any host can time it)

    # -- names
    @abstractmethod
    def queue(self, lane: Lane) -> str:
        """The lane's queue (built by shared.names)."""

    @abstractmethod
    def parse(self, queue: str, host: Host | None = None) -> Lane | None:
        """The lane a queue name names, None when it is not one of this kind. `host` resolves forms that
        name a place on the host the caller runs on (ValueError when such a form comes without it)."""

    # -- share and placement
    @abstractmethod
    def lane_at(self, share: int, host: Host, index: int = 0, device: str | None = None) -> Lane:
        """The `index`-th lane of `share` on the host (or on `device`); ShareError when the share cannot be
        placed there."""

    @abstractmethod
    def lanes_fit(self, share: int, host: Host) -> int:
        """How many lanes of `share` fit side by side on one device of the host."""

    def check_shares(self, shares: list[int], host: Host) -> None:
        """ShareError when one of the shares cannot be placed on the host."""
        for share in shares:
            self.lane_at(share, host)

    def check(self, lane: Lane, host: Host) -> None:
        """LaneError when this host cannot serve the lane at the share its name says (a lane worker checks
        before it takes work)."""

    def environment(self, lane: Lane, device_uuid: str | None = None) -> dict[str, str]:
        """Variables its process must have before TVM's thread pool or CUDA start."""
        return {}

    def pin(self, lane: Lane) -> None:
        """Place this process on the lane (CPU affinity); nothing by default."""

    # -- target and faults
    @abstractmethod
    def family(self, target: dict) -> str:
        """The build family of a target of this kind: what a built artifact depends on."""

    def timing(self) -> dict:
        """The fields of a job's TimingConfig on these lanes that differ from its defaults."""
        return {}

    def fault_domain(self, lane: Lane) -> str | None:
        """The device whose fault ends every lane on it (a GPU under MPS), None when a lane faults alone."""
        return None


_KINDS: dict[str, LaneKind] = {}


def register(lane_kind: type[LaneKind]) -> type[LaneKind]:
    """Class decorator: make a lane kind known by its name and its target kind."""
    _KINDS[lane_kind.name] = lane_kind()
    return lane_kind


def kind(name: str) -> LaneKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown lane kind {name!r} (known: {', '.join(sorted(_KINDS))})") from None


def kinds() -> list[LaneKind]:
    return list(_KINDS.values())
