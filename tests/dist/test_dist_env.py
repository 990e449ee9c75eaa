"""overlap.dist in one process: detect_launch over env mappings, argument validation,
and a one-rank init (HashStore, gloo) with a fake NCCL backend."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist

from overlap import dist
from overlap._env import cuda_extra, require
from overlap.dist import DistInitError, LaunchEnv, detect_launch
from tests._fake_nccl import FakeNccl, FakeNcclConfig

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def _env(**kw: object) -> dict[str, str]:
    return {k: str(v) for k, v in kw.items()}


# ---- detect_launch: the good cases ---------------------------------------------------


def test_single_when_nothing_set() -> None:
    assert detect_launch({}) == LaunchEnv(launcher="single", rank=0, world_size=1,
                                          local_rank=0, local_world_size=1)


def test_single_ignores_unrelated_vars_and_keeps_master() -> None:
    env = detect_launch({"PATH": "/bin", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (env.launcher, env.master_addr, env.master_port) == ("single", "h", 1234)


def test_torchrun() -> None:
    assert detect_launch(TORCHRUN) == LaunchEnv(
        launcher="torchrun", rank=1, world_size=4, local_rank=1, local_world_size=2,
        master_addr="10.0.0.1", master_port=29500)


def test_torchrun_without_local_vars_is_one_node() -> None:
    env = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL")}
    e = detect_launch(env)
    assert (e.local_rank, e.local_world_size) == (1, 4)


def test_torchrun_local_rank_without_local_world_size() -> None:
    env = dict(TORCHRUN)
    del env["LOCAL_WORLD_SIZE"]
    assert detect_launch(env).local_world_size == 4


def test_torchrun_world_of_one_needs_no_master() -> None:
    e = detect_launch(_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1))
    assert (e.launcher, e.world_size, e.master_addr) == ("torchrun", 1, None)


def test_whitespace_is_tolerated() -> None:
    env = dict(TORCHRUN, RANK=" 2 ", LOCAL_RANK="0\n")
    assert (detect_launch(env).rank, detect_launch(env).local_rank) == (2, 0)


def test_open_mpi() -> None:
    assert detect_launch(OMPI) == LaunchEnv(launcher="mpirun", rank=3, world_size=4,
                                            local_rank=1, local_world_size=2)


def test_open_mpi_also_setting_pmix_rank() -> None:
    # Open MPI 4 sets PMIX_RANK too; inside a Slurm allocation SLURM_NTASKS may differ.
    e = detect_launch(dict(OMPI, PMIX_RANK="3", SLURM_NTASKS="64"))
    assert (e.rank, e.world_size) == (3, 4)


def test_hydra() -> None:
    e = detect_launch(HYDRA)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.local_world_size) == (
        "mpirun", 3, 4, 1, 2)


def test_hydra_without_local_vars_is_provisionally_one_node() -> None:
    e = detect_launch(_env(PMI_RANK=2, PMI_SIZE=4))
    assert (e.launcher, e.local_rank, e.local_world_size) == ("mpirun", 2, 4)


def test_open_mpi_and_hydra_agreeing() -> None:
    e = detect_launch({**OMPI, **HYDRA})
    assert (e.rank, e.world_size, e.local_rank) == (3, 4, 1)


def test_pmix_with_slurm_size() -> None:
    e = detect_launch(_env(PMIX_RANK=5, SLURM_STEP_NUM_TASKS=8, SLURM_NTASKS=16, SLURM_LOCALID=1))
    assert (e.launcher, e.rank, e.world_size, e.local_rank) == ("mpirun", 5, 8, 1)


def test_torchrun_vars_agreeing_with_mpi_and_master_set_is_torchrun() -> None:
    env = {**OMPI, **_env(RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, MASTER_ADDR="a", MASTER_PORT=1)}
    assert detect_launch(env).launcher == "torchrun"


def test_torchrun_vars_agreeing_with_mpi_without_master_is_mpirun() -> None:
    env = {**OMPI, **_env(RANK=3, WORLD_SIZE=4)}
    assert detect_launch(env).launcher == "mpirun"


def test_torchrun_vars_without_local_take_local_from_mpi() -> None:
    env = {**OMPI, **_env(RANK=3, WORLD_SIZE=4, MASTER_ADDR="a", MASTER_PORT=1)}
    e = detect_launch(env)
    assert (e.launcher, e.local_rank, e.local_world_size) == ("torchrun", 1, 2)


def test_default_environ_is_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (*TORCHRUN, *OMPI, *HYDRA, "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert detect_launch().rank == 1


# ---- detect_launch: errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        (_env(RANK=0), "WORLD_SIZE is not"),
        (_env(WORLD_SIZE=2), "RANK is not"),
        (_env(LOCAL_RANK=0), "RANK is not"),
        (_env(RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="a", MASTER_PORT=1),
         "LOCAL_WORLD_SIZE is set but LOCAL_RANK"),
        (_env(RANK="one", WORLD_SIZE=2), "RANK='one' is not an integer"),
        (_env(RANK=0, WORLD_SIZE="2.0"), "WORLD_SIZE='2.0' is not an integer"),
        (_env(RANK=2, WORLD_SIZE=2, MASTER_ADDR="a", MASTER_PORT=1), "RANK=2 must be in 0..WORLD_SIZE-1"),
        (_env(RANK=-1, WORLD_SIZE=2, MASTER_ADDR="a", MASTER_PORT=1), "RANK=-1"),
        (_env(RANK=0, WORLD_SIZE=0), "WORLD_SIZE=0 must be >= 1"),
        (_env(RANK=0, WORLD_SIZE=4, LOCAL_RANK=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="a", MASTER_PORT=1),
         "LOCAL_RANK=2 must be in 0..LOCAL_WORLD_SIZE-1"),
        (_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=3, MASTER_ADDR="a", MASTER_PORT=1),
         "LOCAL_WORLD_SIZE=3 must be in 1..WORLD_SIZE"),
        (_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0), "MASTER_ADDR is not"),
        (_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="a"), "MASTER_PORT is not"),
        (dict(TORCHRUN, MASTER_PORT="70000"), "MASTER_PORT=70000"),
        (dict(TORCHRUN, MASTER_PORT="0"), "MASTER_PORT=0"),
        (dict(TORCHRUN, MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
        (_env(OMPI_COMM_WORLD_RANK=0), "OMPI_COMM_WORLD_SIZE is not"),
        (_env(PMI_RANK=0), "PMI_SIZE is not"),
        (_env(PMIX_RANK=0), "PMIX_RANK is set but no world size"),
        (dict(OMPI, OMPI_COMM_WORLD_RANK="4"), "Open MPI rank=4"),
        (dict(OMPI, OMPI_COMM_WORLD_LOCAL_RANK="x"), "OMPI_COMM_WORLD_LOCAL_RANK='x'"),
        ({**OMPI, **HYDRA, "PMI_RANK": "2"}, "Open MPI says rank 3 of 4 but Hydra/PMI says rank 2 of 4"),
        ({**OMPI, **TORCHRUN}, "disagree with Open MPI"),
        ({**OMPI, **TORCHRUN, "RANK": "3", "WORLD_SIZE": "8"}, "disagree"),
        ({**HYDRA, **TORCHRUN, "RANK": "3", "LOCAL_RANK": "0"}, "disagree with Hydra/PMI"),
    ],
)
def test_bad_env_raises(env: dict[str, str], needle: str) -> None:
    with pytest.raises(DistInitError, match=None) as info:
        detect_launch(env)
    assert needle in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kw",
    [
        dict(launcher="slurm", rank=0, world_size=1, local_rank=0, local_world_size=1),
        dict(launcher="single", rank=0, world_size=2, local_rank=0, local_world_size=1),
        dict(launcher="mpirun", rank=2, world_size=2, local_rank=0, local_world_size=1),
        dict(launcher="mpirun", rank=0, world_size=2, local_rank=1, local_world_size=1),
        dict(launcher="torchrun", rank=0, world_size=2, local_rank=0, local_world_size=2),
        dict(launcher="torchrun", rank=0, world_size=2, local_rank=0, local_world_size=2,
             master_addr="a", master_port=0),
    ],
)
def test_launch_env_validates_itself(kw: dict) -> None:
    with pytest.raises(DistInitError):
        LaunchEnv(**kw)


def test_launch_env_is_frozen_and_keyword_only() -> None:
    e = detect_launch({})
    with pytest.raises(AttributeError):
        e.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        LaunchEnv("single", 0, 1, 0, 1)  # type: ignore[misc]


# ---- init in one process ---------------------------------------------------------------


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNccl]:
    """A clean one-process launch environment with a fake NCCL backend installed."""
    for k in list(__import__("os").environ):
        if k in TORCHRUN or k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    fake = FakeNccl()
    prev = dist.set_nccl_backend(fake)
    assert dist.get_context() is None and not tdist.is_initialized()
    yield fake
    dist.shutdown()
    dist.set_nccl_backend(prev)
    assert not tdist.is_initialized()


def test_init_single_process(single: FakeNccl) -> None:
    ctx = dist.init()
    assert (ctx.launch.launcher, ctx.backend, ctx.device) == ("single", "gloo", torch.device("cpu"))
    assert (ctx.tp_size, ctx.tp_rank, ctx.dp_size, ctx.dp_rank, ctx.is_main) == (1, 0, 1, 0, True)
    assert dist.get_context() is ctx and dist.init() is ctx and dist.init(tp_size=1) is ctx
    for call in range(2):  # collectives work on every group, as in a real job
        x = torch.arange(4.0) + call
        y = x.clone()
        tdist.all_reduce(y, group=ctx.tp_group)
        assert torch.equal(x, y)
    ctx.barrier()
    assert dist.group_ranks(ctx.tp_group) == dist.group_ranks(ctx.dp_group) == [0]


def test_shutdown_lets_the_groups_go(single: FakeNccl) -> None:
    """After shutdown neither the context the caller keeps nor a reference cycle (as a
    handled collective error's traceback makes) keeps a process group alive: left to the
    interpreter's exit, their teardown (gloo's threads) aborted a rank now and then."""
    import weakref

    ctx = dist.init()
    groups = [weakref.ref(g) for g in (ctx.world_group, ctx.tp_group, ctx.dp_group)]
    cycle: list = [ctx.tp_group]
    cycle.append(cycle)
    del cycle
    dist.shutdown()
    assert ctx.world_group is None and ctx.tp_group is None and ctx._store is None
    assert all(g() is None for g in groups), "a process group outlived shutdown"


def test_init_conflicting_args_raise(single: FakeNccl) -> None:
    dist.init(timeout_s=30)
    for kw in (dict(tp_size=1, timeout_s=31), dict(backend="nccl", timeout_s=30),
               dict(device="cuda", timeout_s=30)):
        with pytest.raises(DistInitError, match="already called"):
            dist.init(**kw)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(tp_size=2), "does not divide world_size=1"),
        (dict(tp_size=0), "positive int"),
        (dict(tp_size=True), "positive int"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(timeout_s=float("inf")), "timeout_s"),
        (dict(backend="nccl", device="cpu"), "needs a CUDA device"),
    ],
)
def test_init_bad_args_raise_before_any_group(single: FakeNccl, kw: dict, needle: str) -> None:
    with pytest.raises(DistInitError, match=needle):
        dist.init(**kw)
    assert not tdist.is_initialized() and dist.get_context() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_init_cuda_device_without_cuda(single: FakeNccl) -> None:
    with pytest.raises(DistInitError, match="CUDA is not available"):
        dist.init(device="cuda")


def test_world_size_not_divisible_by_tp_size_in_env(monkeypatch: pytest.MonkeyPatch,
                                                      single: FakeNccl) -> None:
    """Fails from the environment alone: no store is contacted (nothing listens there)."""
    for k, v in dict(TORCHRUN, RANK="0", WORLD_SIZE="6", LOCAL_RANK="0",
                     LOCAL_WORLD_SIZE="6", MASTER_ADDR="127.0.0.1", MASTER_PORT="9").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistInitError, match="tp_size=4 does not divide world_size=6"):
        dist.init(tp_size=4, timeout_s=1)
    assert not tdist.is_initialized()


def test_init_adopts_a_process_group_the_caller_made(single: FakeNccl) -> None:
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(DistInitError, match="backend 'gloo', not 'mpi'"):
            dist.init(backend="mpi")
        ctx = dist.init()
        assert ctx.world_group is tdist.group.WORLD and ctx.backend == "gloo"
        comm = dist.nccl_comm()  # the caller's default store carries the bootstrap
        assert (comm.nranks, comm.rank) == (1, 0)
        dist.shutdown()
        assert tdist.is_initialized() and comm.destroyed  # the caller's group is the caller's
    finally:
        tdist.destroy_process_group()


def test_nccl_comm_single_rank(single: FakeNccl) -> None:
    ctx = dist.init()
    comm = dist.nccl_comm()
    assert (comm.nranks, comm.rank) == (1, 0) and dist._last_uid_exchange == "local"
    assert dist.nccl_comm(ctx.world_group) is comm and dist.nccl_comm([0]) is comm
    assert dist.nccl_comm(config=FakeNcclConfig()) is comm  # a default config is no config
    comm8 = dist.nccl_comm(config=FakeNcclConfig(max_ctas=8))
    assert comm8 is not comm and comm8.config == FakeNcclConfig(max_ctas=8)
    assert single.version_checks == 2 and len(single.ids_made) == 2
    dist.shutdown()
    assert comm.destroyed and comm8.destroyed


def test_nccl_comm_before_init_raises(single: FakeNccl) -> None:
    with pytest.raises(DistInitError, match="init"):
        dist.nccl_comm()


def test_nccl_version_check_failure_propagates(single: FakeNccl) -> None:
    def bad() -> None:
        raise RuntimeError("cupy NCCL 2.21.5 != torch NCCL 2.28.9")

    single.check_nccl_versions = bad  # type: ignore[method-assign]
    dist.init()
    with pytest.raises(RuntimeError, match="2.21.5"):
        dist.nccl_comm()
    assert single.comms == []


def test_group_ranks_validation(single: FakeNccl) -> None:
    with pytest.raises(DistInitError, match="not initialized"):
        dist.group_ranks(None)
    dist.init()
    assert dist.group_ranks(None) == [0] and dist.group_ranks((0,)) == [0]
    with pytest.raises(ValueError, match="outside the world"):
        dist.group_ranks([1])
    with pytest.raises(ValueError, match="repeat"):
        dist.group_ranks([0, 0])
    with pytest.raises(ValueError, match="no ranks"):
        dist.group_ranks([])
    with pytest.raises(TypeError):
        dist.group_ranks("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dist.group_ranks([0.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a member"):
        dist.group_ranks(tdist.GroupMember.NON_GROUP_MEMBER)  # type: ignore[arg-type]


def test_shutdown_is_idempotent() -> None:
    dist.shutdown()
    dist.shutdown()
    assert dist.get_context() is None


# ---- package import and optional modules ----------------------------------------------


# Top-level modules only a GPU (or an MPI launcher) needs. A CUDA build of torch imports
# some of them itself (cuda.bindings, triton), so the test measures what `import torch`
# loads first, in the same process, and holds overlap to what it adds on top.
GPU_ONLY_MODULES = ("cupy", "cupyx", "cuda", "triton", "mpi4py", "nvidia", "pynvml")

_IMPORT_PROBE = """
import json, sys
only = set(sys.argv[1].split(","))
def loaded():
    return {m.split(".")[0] for m in sys.modules if m.split(".")[0] in only}
import torch
by_torch = loaded()
import overlap
print(json.dumps({"by_torch": sorted(by_torch), "added": sorted(loaded() - by_torch),
                  "version": overlap.__version__}))
"""


def test_package_imports_without_cuda_modules() -> None:
    """`import overlap` adds no GPU-only module beyond those `import torch` loaded."""
    import json
    import subprocess

    import overlap

    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, ",".join(GPU_ONLY_MODULES)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not seen["added"], (f"import overlap loaded {seen['added']} (torch itself loaded "
                               f"{seen['by_torch']}); keep these imports lazy (overlap._env.require)")
    assert seen["version"] == overlap.__version__


def test_require_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"no_such_mod is needed for the NCCL communicator: "
                                          r"pip install 'overlap\[cu13\]'"):
        require("no_such_mod", "cu13", purpose="the NCCL communicator")
    with pytest.raises(ImportError, match=r"pip install 'overlap\[cu12\]' or pip install 'overlap\[cu13\]'"):
        require("no_such_mod.sub", "cu12|cu13")
    with pytest.raises(ImportError, match="^no_such_mod is needed: build it yourself$"):
        require("no_such_mod", "build it yourself")
    assert require("math", "none").sqrt(4) == 2
    assert cuda_extra() in ("cu12", "cu13", "cu12|cu13")


def test_shutdown_runs_hooks_and_ops_forget_their_runtimes() -> None:
    from overlap.ops import _runtime

    calls: list[int] = []

    def hook() -> None:
        calls.append(1)

    dist.on_shutdown(hook)
    try:
        dist.init(timeout_s=10)
        _runtime._runtimes[(("fake",), 0)] = object()  # a runtime built on this init's communicators
        dist.shutdown()
        assert calls == [1]
        assert not _runtime._runtimes, "ops must not reuse communicators shutdown destroyed"
        dist.shutdown()  # twice: hooks do not run again
        assert calls == [1]
    finally:
        dist._shutdown_hooks.remove(hook)
