"""A stand-in for ``overlap._nccl`` that records what the bootstrap asked of it.

Install with ``overlap.dist.set_nccl_backend(FakeNccl())``. It makes a fresh random id
on every ``get_unique_id()`` call, so "every rank holds the same id" proves the id
travelled from one rank to the others rather than being made twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class FakeNcclConfig:
    """Same fields as overlap._nccl.NcclConfig."""

    max_ctas: int | None = None
    min_ctas: int | None = None
    cga_cluster_size: int | None = None

    @property
    def is_default(self) -> bool:
        return self.max_ctas is None and self.min_ctas is None and self.cga_cluster_size is None


@dataclass(eq=False)
class FakeComm:
    unique_id: bytes
    nranks: int
    rank: int
    config: object = None
    destroyed: bool = False

    def destroy(self) -> None:
        self.destroyed = True


@dataclass
class FakeNccl:
    ids_made: list[bytes] = field(default_factory=list)
    version_checks: int = 0
    comms: list[FakeComm] = field(default_factory=list)

    def get_unique_id(self) -> bytes:
        uid = os.urandom(128)
        self.ids_made.append(uid)
        return uid

    def check_nccl_versions(self) -> tuple[int, int, int]:
        self.version_checks += 1
        return (2, 28, 9)

    def nccl_version(self) -> tuple[int, int, int]:
        return (2, 28, 9)

    def NcclCommunicator(self, unique_id: bytes, nranks: int, rank: int, *,  # noqa: N802
                         config: object = None) -> FakeComm:
        comm = FakeComm(unique_id, nranks, rank, config)
        self.comms.append(comm)
        return comm
