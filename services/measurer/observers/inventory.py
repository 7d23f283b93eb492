"""A host's GPUs as an observer's inventory reports them (services.measurer.observers)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from shared.ids import gpu_hex as _hex


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU of this host, as an observer's inventory reports it."""

    index: int
    uuid: str  # full NVML UUID, "GPU-3f2a1c9b-...."
    name: str
    memory_total_mb: int
    sm_count: int | None = None
    compute_capability: tuple[int, int] | None = None

    @property
    def uuid8(self) -> str:
        """The 8 hex digits a lane queue name carries (see shared.lanes.gpu)."""
        return _hex(self.uuid)[:8]

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid}, {self.name})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d
