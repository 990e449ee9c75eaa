"""One rank of the mpirun smoke test (run by test_mpirun_smoke.py via launch/mpirun.sh).

Usage: bash launch/mpirun.sh NP tests/_mpi_smoke.py [TP_SIZE]

Checks that overlap.dist.init() works under mpirun on gloo (rank and local rank from
MPI, store address broadcast over MPI), that all-reduces on the world and tp groups are
right with inputs that change per rank and per call, and that nccl_comm() takes its
unique id through an MPI broadcast (fake NCCL backend). Rank 0 prints "PASS mpirun ...".
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as tdist
from _fake_nccl import FakeNccl
from mpi4py import MPI

from overlap import dist


def _value(rank: int, call: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * (rank + 1) + 100 * rank + 1e4 * call


def main() -> None:
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else None
    fake = FakeNccl()
    dist.set_nccl_backend(fake)
    ctx = dist.init(tp_size=tp, timeout_s=30)
    world = MPI.COMM_WORLD
    assert ctx.launch.launcher == "mpirun", ctx.launch
    assert (ctx.rank, ctx.world_size) == (world.Get_rank(), world.Get_size())
    assert ctx.launch.master_addr and ctx.launch.master_port, ctx.launch
    assert ctx.backend == "gloo" and ctx.device.type == "cpu"
    tp_ranks = dist.group_ranks(ctx.tp_group)
    for call in range(3):  # inputs differ per rank and per call
        x = _value(ctx.rank, call)
        tdist.all_reduce(x)
        assert torch.equal(x, sum(_value(r, call) for r in range(ctx.world_size))), (call, x)
        y = _value(ctx.rank, call)
        tdist.all_reduce(y, group=ctx.tp_group)
        assert torch.equal(y, sum(_value(r, call) for r in tp_ranks)), (call, y)

    comm = dist.nccl_comm()
    how = dist._last_uid_exchange
    assert how == ("mpi" if len(tp_ranks) > 1 else "local"), how
    assert (comm.nranks, comm.rank) == (len(tp_ranks), tp_ranks.index(ctx.rank))
    uids = world.allgather(comm.unique_id)
    assert len({uids[r] for r in tp_ranks}) == 1, "tp members got different ids"
    assert (comm.unique_id in fake.ids_made) == (ctx.rank == tp_ranks[0])
    dist.shutdown()
    assert comm.destroyed
    if ctx.rank == 0:
        print(f"PASS mpirun world={ctx.world_size} tp={ctx.tp_size} uid_exchange={how} "
              f"local={ctx.launch.local_rank}/{ctx.launch.local_world_size} "
              f"store={ctx.launch.master_addr}:{ctx.launch.master_port}", flush=True)


if __name__ == "__main__":
    main()
