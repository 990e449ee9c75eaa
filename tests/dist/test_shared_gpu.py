"""Shared-GPU mode (``overlap.dist.shared``) on the CPU: when it is on, where each rank
runs, the backend, the NCCL refusals, the SM share of the grids and the wait bounds;
and that one GPU per rank is untouched by it."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from overlap import dist
from overlap.dist import DistInitError, LaunchEnv, comms, context
from overlap.dist import shared as sh
from overlap.ops import OverlapConfig
from overlap.ops import _runtime as rtmod
from tests.ops._cpu_runtime import cuda_stand_ins


def _launch(rank: int, local_world: int) -> LaunchEnv:
    return LaunchEnv(launcher="torchrun", rank=rank, world_size=local_world, local_rank=rank,
                     local_world_size=local_world, master_addr="127.0.0.1", master_port=29500)


@pytest.mark.parametrize(("raw", "want"), [(None, None), ("", None), ("auto", None), (" AUTO ", None),
                                           ("1", True), ("true", True), ("yes", True), ("0", False),
                                           ("false", False), ("off", False)])
def test_env_values(raw: str | None, want: bool | None) -> None:
    env = {} if raw is None else {"OVERLAP_SHARED_GPU": raw}
    assert sh.shared_gpu_env(env) is want


def test_env_bad_value_names_the_variable() -> None:
    with pytest.raises(DistInitError, match=r"OVERLAP_SHARED_GPU must be 1, 0 or auto, got '2'"):
        sh.shared_gpu_env({"OVERLAP_SHARED_GPU": "2"})


def test_placement() -> None:
    # enough GPUs: one each, the mode off unless asked for (production)
    assert [sh.place_on_gpus(r, r, 2, 2, None) for r in range(2)] == [(0, 1, False), (1, 1, False)]
    assert [sh.place_on_gpus(r, r, 2, 8, False) for r in range(2)] == [(0, 1, False), (1, 1, False)]
    # more ranks than GPUs: round-robin, each GPU's share counted
    assert [sh.place_on_gpus(r, r, 2, 1, None) for r in range(2)] == [(0, 2, True), (0, 2, True)]
    assert [sh.place_on_gpus(r, r, 3, 2, None) for r in range(3)] == [(0, 2, True), (1, 1, True), (0, 2, True)]
    assert [sh.place_on_gpus(r, r, 4, 1, None)[:2] for r in range(4)] == [(0, 4)] * 4
    # asked for: on even with enough GPUs
    assert sh.place_on_gpus(1, 1, 2, 2, True) == (1, 1, True)
    assert sh.place_on_gpus(1, 1, 2, 1, True) == (0, 2, True)
    with pytest.raises(DistInitError, match=r"OVERLAP_SHARED_GPU=0 turns shared-GPU mode off"):
        sh.place_on_gpus(1, 1, 2, 1, False)
    with pytest.raises(DistInitError, match="no CUDA GPU"):
        sh.place_on_gpus(0, 0, 2, 0, True)


def test_sm_share() -> None:
    assert [sh.sm_share(132, s) for s in (1, 2, 3, 4)] == [132, 66, 44, 33]
    for bad in ((132, 0), (0, 1), (4, 8)):
        with pytest.raises(ValueError, match="sm_share"):
            sh.sm_share(*bad)


def test_library_wait_bounds() -> None:
    assert sh.library_wait_ms(5000, False) == 5000.0
    assert sh.library_wait_ms(5000, True) == sh.SHARED_WAIT_FLOOR_MS
    assert sh.library_wait_ms(90_000, True) == 90_000.0
    # the tuner's own bound rises in the mode; a bound the candidate sets stays as given
    assert rtmod.tuning_bound(OverlapConfig()).timeout_ms == rtmod.TUNE_TIMEOUT_MS
    assert rtmod.tuning_bound(OverlapConfig(), True).timeout_ms == sh.SHARED_WAIT_FLOOR_MS
    assert rtmod.tuning_bound(OverlapConfig(timeout_ms=50.0), True).timeout_ms == 50.0


def _fake_cuda(n_gpu: int) -> mock._patch:
    return mock.patch.multiple(torch.cuda, is_available=lambda: True, device_count=lambda: n_gpu)


def test_device_and_backend_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OVERLAP_SHARED_GPU", raising=False)
    with _fake_cuda(1):
        dev, share, on = context._resolve_device(None, _launch(1, 2))
        assert (dev, share, on) == (torch.device("cuda", 0), 2, True)
        assert context._resolve_backend(None, dev, on) == "gloo"
        with pytest.raises(DistInitError, match="Duplicate GPU detected"):
            context._resolve_backend("nccl", dev, on, _launch(1, 2))
        assert context._resolve_device("cuda", _launch(1, 2)) == (torch.device("cuda", 0), 2, True)
        # a device the caller names: shared only where asked for
        assert context._resolve_device("cuda:0", _launch(1, 2)) == (torch.device("cuda", 0), 1, False)
        monkeypatch.setenv("OVERLAP_SHARED_GPU", "0")
        with pytest.raises(DistInitError, match="only 1 GPU"):
            context._resolve_device(None, _launch(1, 2))
        monkeypatch.setenv("OVERLAP_SHARED_GPU", "1")
        assert context._resolve_device("cuda:0", _launch(1, 2)) == (torch.device("cuda", 0), 2, True)
    with _fake_cuda(2):  # production: a GPU per rank, NCCL, the mode off
        monkeypatch.delenv("OVERLAP_SHARED_GPU")
        dev, share, on = context._resolve_device(None, _launch(1, 2))
        assert (dev, share, on) == (torch.device("cuda", 1), 1, False)
        assert context._resolve_backend(None, dev, on) == "nccl"
        assert context._resolve_backend("nccl", dev, on) == "nccl"


def test_nccl_comm_refused_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = SimpleNamespace(shared_gpu=True, rank=1, tp_group="tp")
    monkeypatch.setattr(comms, "get_context", lambda: ctx)
    monkeypatch.setattr(comms, "group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(comms, "_get_nccl_backend", lambda: pytest.fail("an NCCL communicator was asked for"))
    with pytest.raises(DistInitError, match=r"nccl_comm\(\): rank 1: shared-GPU mode .*ranks \[0, 1\] share a GPU"):
        dist.nccl_comm()


def _runtime(monkeypatch: pytest.MonkeyPatch, ctx: object | None) -> rtmod.Runtime:
    monkeypatch.setattr(dist, "get_context", lambda: ctx)
    with cuda_stand_ins(132):
        rt = rtmod.Runtime("group", (0, 1), 0, torch.device("cpu"))
    rt._heap, rt._p2p_why = object(), ""  # peer memory opened (collective on a GPU)
    return rt


def test_runtime_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = SimpleNamespace(shared_gpu=True, gpu_share=2, device=torch.device("cpu"))
    rt = _runtime(monkeypatch, ctx)
    assert (rt.num_sms, rt.gpu_share, rt.shared_gpu) == (66, 2, True)
    assert rt.transport(OverlapConfig()) == "p2p"
    assert rt.transport(OverlapConfig(transport="p2p")) == "p2p"
    with pytest.raises(RuntimeError, match=r"transport 'nccl': rank 0: shared-GPU mode"):
        rt.transport(OverlapConfig(transport="nccl"))
    monkeypatch.setenv("OVERLAP_TRANSPORT", "nccl")
    with pytest.raises(RuntimeError, match="Duplicate GPU detected"):
        rt.transport(OverlapConfig())
    with pytest.raises(RuntimeError, match=r"the NCCL transport: rank 0: shared-GPU mode"):
        rt.comm(None)
    rt._heap, rt._p2p_why = None, "cupy: no module"
    monkeypatch.delenv("OVERLAP_TRANSPORT")
    with pytest.raises(RuntimeError, match="needs the peer-copy transport, and it is unavailable: cupy: no module"):
        rt.transport(OverlapConfig())


def test_runtime_one_gpu_per_rank_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    for ctx in (None, SimpleNamespace(shared_gpu=False, gpu_share=1, device=torch.device("cpu")),
                SimpleNamespace(shared_gpu=True, gpu_share=2, device=torch.device("cuda", 0))):  # another device
        rt = _runtime(monkeypatch, ctx)
        assert (rt.num_sms, rt.gpu_share, rt.shared_gpu) == (132, 1, False)
        assert rt.transport(OverlapConfig(transport="nccl")) == "nccl"
        assert rt.transport(OverlapConfig()) == "p2p"


def test_sharing_found_in_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks placed on one GPU by other means (CUDA_VISIBLE_DEVICES, an explicit device):
    found when the group's peer memory is opened, from every rank's (host, GPU id)."""
    rt = _runtime(monkeypatch, None)
    rtmod._note_sharing(rt, "h", [("h", "gpu-a"), ("h", "gpu-b")])
    assert (rt.num_sms, rt.gpu_share, rt.shared_gpu) == (132, 1, False)
    rtmod._note_sharing(rt, "h", [("h", "gpu-a"), ("other", "gpu-a")])  # same id, other host
    assert (rt.num_sms, rt.shared_gpu) == (132, False)
    rtmod._note_sharing(rt, "h", [("h", "gpu-a"), ("h", "gpu-a")])
    assert (rt.num_sms, rt.gpu_share, rt.shared_gpu) == (66, 2, True)
    with pytest.raises(RuntimeError, match="shared-GPU mode"):
        rt.transport(OverlapConfig(transport="nccl"))
    # a context that already counted more ranks on the GPU keeps its share
    rt = _runtime(monkeypatch, SimpleNamespace(shared_gpu=True, gpu_share=4, device=torch.device("cpu")))
    rtmod._note_sharing(rt, "h", [("h", "gpu-a"), ("h", "gpu-a")])
    assert (rt.num_sms, rt.gpu_share) == (33, 4)


def test_capture_refused_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture would hold the reference's gloo collective (host work): a clear error."""
    rt = _runtime(monkeypatch, SimpleNamespace(shared_gpu=True, gpu_share=2, device=torch.device("cpu")))
    monkeypatch.setattr(rtmod, "capturing", lambda: True)
    with pytest.raises(rtmod.OverlapCaptureError, match="cannot be captured in a CUDA graph: their host collectives"):
        rt.transport(OverlapConfig())
    rt = _runtime(monkeypatch, None)  # one GPU per rank: the transport is chosen as before
    assert rt.transport(OverlapConfig()) == "p2p"


def test_tuners_leave_nccl_out_in_the_mode() -> None:
    """The tuners' default lists hold NCCL candidates and chunked baselines (NCCL calls):
    in the mode each would raise the refusal mid-tuning; they are left out, with a warning."""
    cands = [OverlapConfig(chunks=2, transport="nccl"), OverlapConfig(chunks=2, transport="p2p"), OverlapConfig()]
    base = {rtmod.Chunked(2): lambda: None}
    prod = SimpleNamespace(shared_gpu=False, world=2)
    assert rtmod.shared_gpu_choices(prod, "op", cands, base) == (cands, base)
    one = SimpleNamespace(shared_gpu=True, world=1)
    assert rtmod.shared_gpu_choices(one, "op", cands, base) == (cands, base)
    rt = SimpleNamespace(shared_gpu=True, world=2)
    with pytest.warns(UserWarning, match=r"op: tuner: shared-GPU mode: 1 NCCL candidate\(s\) and 1 chunked"):
        keep, kept_base = rtmod.shared_gpu_choices(rt, "op", cands, base)
    assert keep == cands[1:] and kept_base is None


def test_all_reduce_matmul_weight_list_avoids_nccl_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A list of weights with no transport named runs as one grid on NCCL; in the mode it
    takes the widest weight on the peer-copy transport instead of the refusal."""
    from overlap.ops import all_reduce as armod

    rt = SimpleNamespace(shared_gpu=True, world=2, p2p=lambda: None)
    monkeypatch.setattr(armod, "get_runtime", lambda group, device: rt)
    monkeypatch.setattr(armod, "resolve_group", lambda group: "group")
    seen: list[str] = []
    monkeypatch.setattr(armod, "_widest", lambda *args: seen.append(args[-1]) or "widest")
    x = torch.randn(8, 16, dtype=torch.float16)
    bs = [torch.randn(16, 8, dtype=torch.float16), torch.randn(16, 16, dtype=torch.float16)]
    with mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock, return_value=True):
        for cfg in (None, OverlapConfig(chunks=2)):
            assert armod.all_reduce_matmul(x, bs, config=cfg) == "widest"
    assert seen == ["shared-GPU mode: the peer-copy transport takes one weight"] * 2


def test_gloo_group_not_bound_to_the_gpu() -> None:
    """Binding a gloo default group to a CUDA device made every subgroup (the dp groups)
    fail in torch 2.11: ProcessGroupGloo has no ``perform_nocolor_split``."""
    cuda = torch.device("cuda", 0)
    assert context._bound_device("gloo", cuda) is None
    assert context._bound_device("gloo", torch.device("cpu")) is None
    assert context._bound_device("nccl", cuda) == cuda


def test_producer_ops_take_the_peer_copy_transport_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """matmul_reduce_scatter / matmul_all_reduce default to NCCL where no transport is named
    (on a GPU run at d9c328a, the layers' backward and both ops raised the NCCL refusal)."""
    from overlap.ops import matmul_reduce as mrmod

    monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
    rt = _runtime(monkeypatch, SimpleNamespace(shared_gpu=True, gpu_share=2, device=torch.device("cpu")))
    assert mrmod._transport(rt, OverlapConfig()) == "p2p"
    assert mrmod._transport(rt, OverlapConfig(chunks=2)) == "p2p"
    prod = _runtime(monkeypatch, None)  # one GPU per rank: NCCL unless the peer-copy one is named
    assert mrmod._transport(prod, OverlapConfig()) == "nccl"
    assert mrmod._transport(prod, OverlapConfig(transport="p2p")) == "p2p"


def test_matmul_all_reduce_matmul_runs_its_halves_in_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's pipeline runs on NCCL (refused in the mode): in the mode it runs as
    matmul_all_reduce (peer-copy transport) and then norm(h) @ b_next, the reference's
    arithmetic, with the caller's config handed to matmul_all_reduce (which refuses
    transport='nccl' with the mode's error)."""
    from overlap.ops import Norm
    from overlap.ops import boundary as bmod
    from overlap.ops import matmul_reduce as mrmod

    rt = SimpleNamespace(shared_gpu=True, world=2)
    monkeypatch.setattr(bmod, "get_runtime", lambda group, device: rt)
    monkeypatch.setattr(bmod, "resolve_group", lambda group: "group")
    monkeypatch.setattr(bmod, "_fused", lambda *a: pytest.fail("the NCCL pipeline ran in shared-GPU mode"))
    seen: list[object] = []

    def mar(a: torch.Tensor, b: torch.Tensor, *, group: object, residual: torch.Tensor | None,
            config: object) -> torch.Tensor:  # one rank's view: its partial product is the sum
        seen.append((group, config))
        return (a.float() @ b.float() + (0 if residual is None else residual.float())).to(a.dtype)

    monkeypatch.setattr(mrmod, "matmul_all_reduce", mar)
    g = torch.Generator().manual_seed(3)
    for it, cfg in enumerate((None, OverlapConfig(chunks=2), OverlapConfig(transport="p2p"))):
        a = torch.randn(64, 32, generator=g).half()  # new inputs every call
        b = (torch.randn(48, 32, generator=g) / 6).half().t()
        b_next = (torch.randn(16, 48, generator=g) / 7).half().t()
        res = torch.randn(64, 48, generator=g).half()
        norm = Norm("layernorm", (torch.rand(48, generator=g) + 0.5).half(), torch.randn(48, generator=g).half(),
                    1e-5)
        before = bmod.stats["shared_gpu"]
        with mock.patch.object(torch.Tensor, "is_cuda", new_callable=mock.PropertyMock, return_value=True):
            c, h = bmod.matmul_all_reduce_matmul(a, b, b_next, residual=res, norm=norm, config=cfg)
        assert bmod.stats["shared_gpu"] == before + 1
        assert seen[-1] == ("group", cfg)
        h_ref = mar(a, b, group=None, residual=res, config=None)
        assert torch.equal(h, h_ref)
        assert torch.equal(c, norm.apply(h_ref) @ b_next), f"call {it}"
    assert len(seen) == 3 + 3  # the op's call and the check's own
