"""The warp-specialized Gluon GEMM on the CPU: its config's refusals, the version shim, and
its sm_90 build (Triton's own ptxas, no GPU): who waits, who loads, who multiplies.
Its results are checked on the GPU (tests/gpu/test_gluon_gemm_gpu.py)."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from overlap.kernels import _gluon_compat as compat  # noqa: E402
from overlap.kernels.gluon_gemm import GluonGemmConfig  # noqa: E402


def test_config_refuses_what_does_not_fit() -> None:
    GluonGemmConfig()
    GluonGemmConfig(block_m=256, block_n=128)
    with pytest.raises(ValueError, match="tile is one of"):
        GluonGemmConfig(block_m=64)
    with pytest.raises(ValueError, match="block_k"):
        GluonGemmConfig(block_k=48)
    with pytest.raises(ValueError, match="227 KiB"):
        GluonGemmConfig(stages=4)  # 4 x 48 KiB ring + 64 KiB C tile
    assert GluonGemmConfig(stages=4, block_k=32).smem_bytes(2) < 227 * 1024
    GluonGemmConfig(block_m=128, block_n=128, pingpong=True, stages=5)
    GluonGemmConfig(block_m=64, block_n=256, pingpong=True, stages=4)
    with pytest.raises(ValueError, match="ping-pong tile"):
        GluonGemmConfig(pingpong=True)  # 128x256 fp32 in one warpgroup's registers: 256 a thread
    with pytest.raises(ValueError, match="227 KiB"):
        GluonGemmConfig(block_m=128, block_n=128, pingpong=True, stages=6)  # 6 x 32 KiB + 2 x 32 KiB
    with pytest.raises(ValueError, match="loader_regs"):
        GluonGemmConfig(loader_regs=20)


def test_compat_resolves_this_triton() -> None:
    """The shim names this Triton's TMA copies (3.9 keeps the 3.6 names only to raise)."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from triton.experimental.gluon.language.nvidia.hopper import tma

    new = hasattr(tma, "async_load")
    assert compat.tma_load is (tma.async_load if new else tma.async_copy_global_to_shared)
    assert compat.tma_store is (tma.async_store if new else tma.async_copy_shared_to_global)
    assert compat.WS_LIST_FORM in (True, False) and compat.REASON == ""


def test_launch_refuses_bad_operands_before_any_work() -> None:
    from overlap.kernels.gluon_gemm import launch_gluon_gemm

    if not compat.AVAILABLE:
        with pytest.raises(RuntimeError, match="gluon_gemm"):
            launch_gluon_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1),
                              torch.zeros(1, 8, dtype=torch.int32), grid=1)
        return
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(128, 256, dtype=torch.bfloat16)
    c = torch.zeros(256, 256, dtype=torch.bfloat16)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    cases = {"do not make": (a, b[:64], c, tab, {}), "dtypes differ": (a.float(), b, c, tab, {}),
             "int32": (a, b, c, tab[:, :7], {}), "grid": (a, b, c, tab, {"grid": 0}),
             "error word": (a, b, c, tab, {"flags": torch.zeros(4, dtype=torch.int32)}),
             "row-major": (a, b, c.t(), tab, {})}
    for want, (aa, bb, cc, tt, kw) in cases.items():
        with pytest.raises(ValueError, match=want):
            launch_gluon_gemm(aa, bb, cc, tt, **{"grid": 1, **kw})


@functools.lru_cache(maxsize=None)
def sm90(block_m: int = 128, block_n: int = 256, b_kn: bool = False, has_wait: bool = True,
         has_a2: bool = False, pingpong: bool = False, dynamic: bool = False, clip: bool = False,
         post: bool = False, stages: int = 0, tma_c: bool = True, aligned: bool = False, ahead: bool = False,
         split: bool = False) -> Any:
    """``gluon_gemm_kernel`` compiled for sm_90 on the CPU (Triton's own ptxas). ``aligned``:
    C's pointer, its row stride, N and K marked divisible by 16, as a launch specializes them
    on such operands (what lets stores be 16 bytes wide)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from overlap.kernels import gluon_gemm as gg

    cfg = GluonGemmConfig(block_m=block_m, block_n=block_n, pingpong=pingpong, tma_epilogue=tma_c,
                          stages=stages or (5 if pingpong else (4 if block_n == 192 else 3)))
    a = torch.empty(512, 512, dtype=torch.bfloat16)
    w = torch.empty(512, 512, dtype=torch.bfloat16)
    c = torch.empty(512, 512, dtype=torch.bfloat16)
    *descs, kn = gg.descriptors(a, w if b_kn else w.t(), c, cfg, a if has_a2 else None)
    assert kn == b_kn
    names = ("a_desc", "a2_desc", "b_desc", "b1_desc", "c_desc", "c1_desc") if cfg.wide else \
        ("a_desc", "a2_desc", "b_desc", "c_desc")
    assert len(descs) == len(names)
    i32 = torch.empty(8, dtype=torch.int32)
    fn = {"pp": gg.gluon_gemm_pp_kernel, "wide": gg.gluon_gemm_wide_kernel, "plain": gg.gluon_gemm_kernel}[cfg.kind]
    vals = dict(zip(names, descs), c_ptr=c, table_ptr=i32, flags_ptr=i32, err_ptr=i32, counter_ptr=i32,
                ws_ptr=torch.empty(8, dtype=torch.float32), sk_ptr=i32)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, STAGES=cfg.stages, B_KN=b_kn, HAS_A2=has_a2,
                HAS_WAIT=has_wait, ACTIVATION=0, DYNAMIC=dynamic, LOADER_REGS=cfg.loader_regs, MMA_REGS=232,
                WS_LIST=compat.WS_LIST_FORM, CLIP=clip, POST=post, TMA_C=tma_c, AHEAD=ahead, SPLIT=split,
                num_warps=cfg.num_warps)
    sig, consts, attrs = {}, {}, {}
    for i, nm in enumerate(fn.arg_names):
        if nm in meta:
            sig[nm], consts[nm] = "constexpr", meta[nm]
        else:
            sig[nm] = mangle_type(vals.get(nm, 7))
        if aligned and nm in ("c_ptr", "stride_cm", "N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, maxnreg=168))


def _build(**kw: Any) -> Any:
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    try:
        return sm90(**kw)
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools here
        if "ptxas" in str(e) or "No such file" in str(e):
            pytest.skip(f"no sm_90 build here: {type(e).__name__}: {e}")
        raise


def _regions(k: Any) -> tuple[str, ...]:
    """The kernel's TTGIR by partition: the default one, then the workers in order."""
    ir = k.asm["ttgir"]
    cuts = [ir.index("ttg.warp_specialize")]
    while f"partition{len(cuts) - 1}(" in ir:
        cuts.append(ir.index(f"partition{len(cuts) - 1}(", cuts[-1]))
    return tuple(ir[a:b] for a, b in zip(cuts, cuts[1:] + [len(ir)]))


def _barriers(region: str) -> int:
    """Barriers of a partition's threads in its TTGIR (``gpu.barrier`` in Triton 3.6)."""
    return region.count("ttg.barrier") + region.count("gpu.barrier")


def test_sm90_only_the_loader_waits_and_loads() -> None:
    """The flag wait (acquire polls at system scope, the global timer) and the TMA loads
    sit in the loader partition; the wgmma and the C store in the MMA partition, which
    polls nothing. Without waits there is no poll at all."""
    k = _build()
    mma, loader = _regions(k)
    acquire = "atomic_rmw add, acquire, sys"
    assert acquire in loader and "globaltimer" in loader, "the loader does not wait"
    assert acquire not in mma and "globaltimer" not in mma, "the MMA warps spin on a flag"
    assert "warp_group_dot " in mma and "warp_group_dot " not in loader
    assert loader.count("async_tma_copy_global_to_local") == 2 and "async_tma_copy_global_to_local" not in mma
    assert "async_tma_copy_local_to_global" in mma
    ptx = k.asm["ptx"]
    assert "setmaxnreg" in ptx and "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx and "vote.sync.any.pred" in ptx
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared
    plain_mma, plain_loader = _regions(_build(has_wait=False))
    assert acquire not in plain_mma + plain_loader and "globaltimer" not in plain_mma + plain_loader


def test_sm90_tiles_layouts_and_second_source() -> None:
    """256x128 tiles take m64n128 wgmmas; B row-major [K, N] is read without a transpose
    (its smem tile is [BLOCK_K, BLOCK_N]); a second A source adds one TMA load."""
    k = _build(block_m=256, block_n=128, b_kn=True, has_a2=True)
    mma, loader = _regions(k)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in k.asm["ptx"]
    assert "m64n256k16" not in k.asm["ptx"]
    assert loader.count("async_tma_copy_global_to_local") == 3
    # (Triton 3.6 writes a descriptor's type as tensordesc<tensor<...>>, 3.9 as tensordesc<...>)
    assert re.search(r"tensordesc<(tensor<)?64x128xbf16", loader) and "memdesc<64x128xbf16" in mma
    assert "ttg.memdesc_trans" not in mma
    nk_mma, _ = _regions(_build())
    assert "ttg.memdesc_trans" in nk_mma  # w.t(): the [N, K] tile is fed transposed


def test_sm90_pingpong_two_mma_warpgroups_take_turns() -> None:
    """Ping-pong: two MMA partitions (each its own wgmma on a 128x128 tile, its own C
    store), a turn barrier each waits on and the other arrives at, and still only the
    loader waits on flags and loads."""
    k = _build(block_m=128, block_n=128, pingpong=True)
    parts = _regions(k)
    assert len(parts) == 3, len(parts)
    wg0, wg1, loader = parts
    acquire = "atomic_rmw add, acquire, sys"
    for wg in (wg0, wg1):
        assert "warp_group_dot " in wg and "async_tma_copy_local_to_global" in wg
        assert acquire not in wg and "globaltimer" not in wg and "async_tma_copy_global_to_local" not in wg
        assert wg.count("ttng.wait_barrier") >= 2  # its turn, and the ring's ready slots
    assert acquire in loader and "warp_group_dot " not in loader
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in k.asm["ptx"]
    assert k.metadata.shared <= 227 * 1024, k.metadata.shared


def test_sm90_dispatch_counter_taken_by_the_loader_only() -> None:
    """With a dispatch counter the loader takes each tile by an atomic add and hands it to
    the MMA warps through shared memory (a store there, a load in each MMA partition);
    the MMA partitions touch no counter. Without one there is no atomic add at all."""
    for pp in (False, True):
        k = _build(block_m=128, block_n=128 if pp else 256, pingpong=pp, dynamic=True)
        *mmas, loader = _regions(k)
        take = "atomic_rmw add, relaxed, gpu"
        assert take in loader and "local_store" in loader, pp
        for wg in mmas:
            assert take not in wg and "local_load" in wg, pp
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared
        static = _build(block_m=128, block_n=128 if pp else 256, pingpong=pp)
        assert take not in static.asm["ttgir"]


def test_sm90_row_cut_and_nan_over_skipped_tiles() -> None:
    """A row cut (``rows=``, a row bucket's plan): both the loader (a dead tile neither
    waits nor loads) and the MMA warps (their stores masked at the cut) cut the tile's C
    rows; without it neither does. With waits the MMA warps store NaN (bf16 0x7FC0) over a
    tile skipped after a failed wait; without waits there is no such store."""
    for pp in (False, True):
        tile = dict(block_m=128, block_n=128 if pp else 256, pingpong=pp)
        *mmas, loader = _regions(_build(clip=True, **tile))
        assert "arith.minsi" in loader, pp
        for wg in mmas:
            assert "arith.minsi" in wg, pp
        *plain_mmas, plain_loader = _regions(_build(**tile))
        assert all("arith.minsi" not in r for r in (*plain_mmas, plain_loader)), pp
        assert "dense<0x7FC0>" in _build(clip=True, **tile).asm["ttgir"], pp
        assert "dense<0x7FC0>" not in _build(has_wait=False, **tile).asm["ttgir"], pp


def _error_read_at(region: str) -> str:
    """Where an MMA partition reads the error word (its volatile load) in its K loop's order:
    "first step" (between the loop's first wgmma and its first wait) or "after the loop"."""
    seq = [m.group(0) for m in re.finditer(r"isVolatile|warp_group_dot_wait|warp_group_dot ", region)]
    at = seq.index("isVolatile")
    if seq[:at] and seq[at - 1] == "warp_group_dot " and "warp_group_dot_wait" not in seq[:at]:
        return "first step"
    return "after the loop" if seq[:at].count("warp_group_dot_wait") >= 2 else f"elsewhere: {seq}"


def _taken_in_the_k_loop(loader: str) -> bool:
    """The loader takes a tile from the dispatch counter inside its K loop (before the loop
    body's end), not only after it."""
    seq = [m.group(0) for m in re.finditer(r"scf\.for|scf\.yield|atomic_rmw add, relaxed, gpu", loader)]
    body = seq[seq.index("scf.for"):]
    return "atomic_rmw add, relaxed, gpu" in body[:body.index("scf.yield")]


def test_sm90_ahead_reads_the_next_row_and_passes_a_passed_wait() -> None:
    """``GluonGemmConfig.ahead``: with static tiles the loader reads the next tile's row
    (clamped to the table's last: a min) before the current tile's loads, and compares each
    tile's wait with the last one it passed (flag and multiple) before it polls; with a
    dispatch counter it takes the next tile inside the current one's K loop and reads its
    row there (clamped); the MMA warps read the error word in the tile's first K step, not
    after the loop. Off, none of it."""
    for pp in (False, True):
        tile = dict(block_m=128, block_n=128 if pp else 256, pingpong=pp)
        *mmas, loader = _regions(_build(ahead=True, **tile))
        *plain_mmas, plain = _regions(_build(**tile))
        assert "arith.minsi" in loader and "arith.minsi" not in plain, pp
        assert loader.count("tt.load") >= plain.count("tt.load") + 4, pp  # (the row read before the loop)
        assert loader.count("arith.cmpi eq") >= plain.count("arith.cmpi eq") + 2, pp
        assert loader.count("atomic_rmw add, acquire, sys") == plain.count("atomic_rmw add, acquire, sys"), pp
        assert [_error_read_at(r) for r in mmas] == ["first step"] * len(mmas), pp
        assert [_error_read_at(r) for r in plain_mmas] == ["after the loop"] * len(mmas), pp
        *_, dyn = _regions(_build(ahead=True, dynamic=True, **tile))
        *_, dyn_plain = _regions(_build(dynamic=True, **tile))
        assert "arith.minsi" in dyn and "arith.minsi" not in dyn_plain, pp
        take = "atomic_rmw add, relaxed, gpu"
        assert dyn.count(take) == dyn_plain.count(take) + 1, pp  # (and one after a loop of no K step)
        assert _taken_in_the_k_loop(dyn) and not _taken_in_the_k_loop(dyn_plain), pp
        assert dyn.count("arith.cmpi eq") >= dyn_plain.count("arith.cmpi eq") + 2, pp
    wide_mma, wide = _regions(_build(ahead=True, block_n=192))
    plain_wide_mma, plain_wide = _regions(_build(block_n=192))
    assert "arith.minsi" in wide and "arith.minsi" not in plain_wide
    assert _error_read_at(wide_mma) == "first step" and _error_read_at(plain_wide_mma) == "after the loop"
    regs_mma, _ = _regions(_build(ahead=True, tma_c=False, stages=4))
    assert _error_read_at(regs_mma) == "first step"


def test_sm90_the_mma_warps_decide_on_the_error_word_together() -> None:
    """Each MMA partition reduces its threads' reads of the error word (a max over the
    partition) before it branches into NaN or the store, whose stores hold the partition's
    barriers: warps that read it apart cannot go different ways. Plain, ping-pong (each
    warpgroup its own), 192 columns and C from registers, with and without ``ahead``;
    without waits there is no read to reduce."""
    for kw in (dict(), dict(block_m=128, block_n=128, pingpong=True), dict(block_n=192),
               dict(tma_c=False, stages=4)):
        for ahead in (False, True):
            *mmas, _ = _regions(_build(ahead=ahead, **kw))
            for r in mmas:
                at = r.index("isVolatile")
                assert "tt.reduce" in r[at:at + 1500] and "arith.maxsi" in r[at:at + 1500], (kw, ahead)
    *mmas, _ = _regions(_build(has_wait=False))
    assert all("isVolatile" not in r for r in mmas)
    for ahead in (False, True):  # (the 192-column tile: one read for both its parts, NaN or right whole)
        wide_mma, _ = _regions(_build(ahead=ahead, block_n=192))
        assert wide_mma.count("isVolatile") == 1, ahead


def test_plan_launch_passes_plain_descriptors_once_the_raw_launch_is_known() -> None:
    """A plan's launch before its kernel's C launcher is known passes Gluon descriptors
    (Triton's path compiles and launches with them); after, plain ``HostDesc`` fields the
    C launcher fills once per pointer, each turning into the same Gluon descriptor where a
    launch falls back to Triton's path (``HostDesc.triton``)."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels import _launch
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    w = torch.zeros(256, 128, dtype=torch.bfloat16)  # [N, K]: b = w.t()
    c = torch.zeros(256, 256, dtype=torch.bfloat16)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    plan = GluonGemmPlan(a, w.t(), c, tab)
    got: list = []

    class Prepared:
        raw = None

        def launch(self, grid, args, aligned=()) -> None:  # noqa: ANN001
            got.append(args[:4])

    plan.prepared = Prepared()
    plan.launch(a, w.t(), c, epoch=1, grid=2)
    assert all(type(d) is compat.TensorDescriptor for d in got[-1]), [type(d) for d in got[-1]]
    Prepared.raw = object()
    plan.launch(a, w.t(), c, epoch=1, grid=2)
    descs = got[-1]
    assert all(type(d) is _launch.HostDesc for d in descs), [type(d) for d in descs]
    a_d, _, b_d, c_d = descs
    assert b_d.base.data_ptr() == w.data_ptr() and tuple(b_d.shape) == (256, 128) and list(b_d.block_shape) == \
        [plan.cfg.block_n, plan.cfg.block_k]
    for hd, gd in zip(descs, got[0]):  # the fallback's descriptor is the Gluon one Triton's path took
        back = hd.triton()
        assert type(back) is type(gd) and list(back.block_shape) == list(gd.block_shape) and \
            tuple(back.shape) == tuple(gd.shape) and back.layout == gd.layout


def test_plan_bind_hands_the_bound_launch_what_a_launch_hands_the_kernel(monkeypatch) -> None:
    """``GluonGemmPlan.bind`` (a call plan's bound launch): the programs and arguments its
    launch hands the kernel's launcher, each descriptor with the same fields, and the
    call's tensors in the order a bound body gives them (a, a2, B as stored, c); none
    before the kernel's C launcher is known, or for operands not laid out as the plan's."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels import _launch
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    a2 = torch.zeros(256, 128, dtype=torch.bfloat16)
    w = torch.zeros(256, 128, dtype=torch.bfloat16)  # [N, K]: b = w.t()
    c = torch.zeros(256, 256, dtype=torch.bfloat16)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    launched: list = []
    bound: list = []

    class Prepared:
        raw = None

        def launch(self, grid, args, aligned=()) -> None:  # noqa: ANN001
            launched.append((grid, args))

    monkeypatch.setattr(_launch.BoundLaunch, "of", staticmethod(lambda pl, grid, args, tensors: bound.append(
        (pl, grid, args, tensors)) or "bound"))
    for second in (None, a2):
        plan = GluonGemmPlan(a, w.t(), c, tab, a2=second, clip=True)
        plan.prepared = Prepared()
        assert plan.bind(a, w.t(), c, a2=second, epoch=1, grid=5, rows=(1, 2)) is None  # no C launcher known
        Prepared.raw = object()
        plan.launch(a, w.t(), c, a2=second, epoch=1, grid=5, rows=(1, 2))
        assert plan.bind(a, w.t(), c, a2=second, epoch=1, grid=5, rows=(1, 2)) == "bound"
        pl, grid, args, tensors = bound[-1]
        want_grid, want = launched[-1]
        assert pl is plan.prepared and grid == want_grid == 2  # min(grid, tiles)
        assert len(args) == len(want)
        for got_v, want_v in zip(args, want):
            if type(want_v) is _launch.HostDesc:
                assert type(got_v) is _launch.HostDesc and got_v.base.data_ptr() == want_v.base.data_ptr()
                assert (tuple(got_v.shape), tuple(got_v.strides), list(got_v.block_shape)) == \
                    (tuple(want_v.shape), tuple(want_v.strides), list(want_v.block_shape))
            else:
                assert got_v is want_v or got_v == want_v
        assert tensors[0] is a and tensors[1] is second and tensors[3] is c and tensors[4:] == (None, None)
        assert tensors[2].data_ptr() == w.data_ptr() and tuple(tensors[2].shape) == (256, 128)  # B as stored
        assert args[2].base is tensors[2]  # B's descriptor is of the tensor a call gives in its place
        # operands of another layout, or rows without the plan's clip: not bound
        assert plan.bind(a[:, :64], w.t()[:64], c, a2=second, epoch=1, grid=5, rows=(1, 2)) is None
        assert plan.bind(a, w.t(), c, a2=second, epoch=1, grid=5) is None
        Prepared.raw = None


def test_plan_bind_fills_each_calls_own_descriptors() -> None:
    """The Gluon plan's bound launch, run with a stand-in C launcher: for a call's new
    tensors it hands the launcher exactly what the plan's general raw launch
    (``_launch._RawLaunch``) would for the same tensors: each descriptor filled for that
    call's pointer (A, a2, B as stored, C), C itself in its plain slot, the stream given."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from types import SimpleNamespace

    from overlap.kernels import _launch
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(torch.bfloat16)

    a, a2, w, c = t(256, 128), t(256, 128), t(256, 128), t(256, 256)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    plan = GluonGemmPlan(a, w.t(), c, tab, a2=a2, clip=True)
    calls: list = []
    raw = _launch._RawLaunch()
    raw.c_launch = lambda *args: calls.append(args)
    raw.fill = lambda ptr, *meta: ("filled", ptr, *meta)
    raw.dtypes = {i: f"dtype{i}" for i in range(16)}
    raw.head = ("function", False, False, "packed")
    raw.descs = tuple((i, {"swizzle": 3, "elem_size": 2, "elem_type": 5, "block_size": [64, 64]}) for i in range(4))
    raw.maps = {}
    _, args0 = plan._args(plan._host_descs(a, a2, w, c), c, 1, 5, (1, 2))
    plan.prepared = SimpleNamespace(raw=raw, compiled=object(), owner=SimpleNamespace(enabled=True),
                                    widths=_launch._widths(args0), const_vals=("K1", "K2"), device=None)
    bl = plan.bind(a, w.t(), c, a2=a2, epoch=1, grid=5, rows=(1, 2))
    assert bl is not None, "not bound"
    for i in range(3):
        na, na2, nw, nc = t(256, 128), t(256, 128), t(256, 128), t(256, 256)  # new pointers every call
        bl(100 + i, (na, na2, nw, nc, None, None))
        got = calls[-1]
        nprog, args = plan._args(plan._host_descs(na, na2, nw, nc), nc, 1, 5, (1, 2))
        raw(nprog, 100 + i, args, ("K1", "K2"))
        want = calls[-1]
        assert len(got) == len(want) and all(g is w_ or g == w_ for g, w_ in zip(got, want)), (i, got, want)
        assert [x[1] for x in got if isinstance(x, tuple) and x[:1] == ("filled",)] == \
            [na.data_ptr(), na2.data_ptr(), nw.data_ptr(), nc.data_ptr()]


def test_sm90_wide_tile_two_accumulators() -> None:
    """A 192-column tile (``GluonGemmConfig.wide``): per K step the loader loads A and B's
    two TMA tiles (128 and 64 columns; a second A source adds one), the MMA warps issue an
    m64n128 and an m64n64 wgmma on them, and store C as two TMA tiles; only the loader
    waits. Both B layouts, with waits, a dispatch counter and a row cut; it fits an SM's
    shared memory at 4 stages."""
    acquire = "atomic_rmw add, acquire, sys"
    for b_kn, has_a2, dynamic, clip in ((False, False, False, False), (True, True, True, True)):
        k = _build(block_m=128, block_n=192, b_kn=b_kn, has_a2=has_a2, dynamic=dynamic, clip=clip)
        mma, loader = _regions(k)
        assert loader.count("async_tma_copy_global_to_local") == 3 + has_a2, (b_kn, has_a2)
        assert mma.count("warp_group_dot ") == 2 and "warp_group_dot " not in loader
        assert mma.count("async_tma_copy_local_to_global") == 2
        assert acquire in loader and acquire not in mma and "globaltimer" not in mma
        ptx = k.asm["ptx"]
        assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
        assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
        assert "m64n256k16" not in ptx and "m64n192k16" not in ptx
        assert ("ttg.memdesc_trans" in mma) == (not b_kn)
        assert ("arith.minsi" in mma) == clip and ("atomic_rmw add, relaxed, gpu" in loader) == dynamic
        assert k.metadata.shared <= 227 * 1024, k.metadata.shared


def test_wide_config_and_descriptors() -> None:
    """The 192-column tile is a config of the plain kernel's shape (block_m 128, not in
    ping-pong); its descriptors come as A, A2, B (128 columns), B1 (64), C (128), C1 (64)."""
    cfg = GluonGemmConfig(block_m=128, block_n=192, stages=4)
    assert cfg.wide and cfg.kind == "wide" and cfg.num_warps == 8
    assert cfg.smem_bytes(2) == 4 * (128 + 192) * 64 * 2 + 128 * 192 * 2 + 16 * 4 + 1024
    for bad in (dict(block_m=256, block_n=192), dict(block_m=128, block_n=192, pingpong=True),
                dict(block_m=128, block_n=192, stages=5)):
        with pytest.raises(ValueError):
            GluonGemmConfig(**bad)
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels import gluon_gemm as gg

    a = torch.empty(256, 64, dtype=torch.bfloat16)
    w = torch.empty(320, 64, dtype=torch.bfloat16)
    c = torch.empty(256, 320, dtype=torch.bfloat16)
    for b, kn in ((w.t(), False), (w.t().contiguous(), True)):
        *descs, b_kn = gg.descriptors(a, b, c, cfg)
        assert b_kn == kn and len(descs) == 6
        blocks = [list(d.block_shape) for d in descs]
        assert blocks == [[128, 64], [128, 64]] + ([[64, 128], [64, 64]] if kn else [[128, 64], [64, 64]]) + \
            [[128, 128], [128, 64]], blocks


def test_wide_plan_launches_and_binds_six_descriptors(monkeypatch) -> None:
    """A plan of the 192-column tile hands the wide kernel's launcher A, A2, B (its first 128
    columns), B1 (the last 64), C, C1, each of the call's tensor (B as stored) with its own
    tile, then C itself; before the C launcher is known, the Gluon descriptors of the same
    tiles; its bound launch takes the same arguments."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels import _launch
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    cfg = GluonGemmConfig(block_m=128, block_n=192, stages=4)
    a, w, c = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(384, 128, dtype=torch.bfloat16), \
        torch.zeros(256, 384, dtype=torch.bfloat16)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    launched: list = []
    bound: list = []

    class Prepared:
        raw = None

        def launch(self, grid, args, aligned=()) -> None:  # noqa: ANN001
            launched.append(args)

    monkeypatch.setattr(_launch.BoundLaunch, "of", staticmethod(lambda pl, grid, args, tensors: bound.append(
        (args, tensors)) or "bound"))
    for b, kn in ((w.t(), False), (w.t().contiguous(), True)):
        plan = GluonGemmPlan(a, b, c, tab, config=cfg)
        assert plan.prepared.owner is gg_launchers()["wide"] and plan.b_kn == kn
        plan.prepared = Prepared()
        plan.launch(a, b, c, epoch=1, grid=2)
        gl_descs = launched[-1][:6]
        assert all(type(d) is compat.TensorDescriptor for d in gl_descs)
        Prepared.raw = object()
        plan.launch(a, b, c, epoch=1, grid=2)
        descs, rest = launched[-1][:6], launched[-1][6:]
        assert all(type(d) is _launch.HostDesc for d in descs) and rest[0] is c
        b_store = b if kn else b.t()
        bb = [[64, 128], [64, 64]] if kn else [[128, 64], [64, 64]]
        assert [list(d.block_shape) for d in descs] == [[128, 64], [128, 64], *bb, [128, 128], [128, 64]]
        assert [d.base.data_ptr() for d in descs] == [a.data_ptr()] * 2 + [b_store.data_ptr()] * 2 + \
            [c.data_ptr()] * 2
        assert [list(d.block_shape) for d in gl_descs] == [list(d.block_shape) for d in descs]
        assert plan.bind(a, b, c, epoch=1, grid=2) == "bound"
        args, tensors = bound[-1]
        assert [list(d.block_shape) for d in args[:6]] == [list(d.block_shape) for d in descs]
        assert args[2].base is tensors[2] and args[3].base is tensors[2] and args[5].base is tensors[3] is c
        Prepared.raw = None


def gg_launchers() -> dict:
    from overlap.kernels import gluon_gemm as gg

    return gg._LAUNCHERS


def test_sm90_posts_after_a_barrier_of_the_mma_warps() -> None:
    """``POST`` (a producer's tiles): the MMA partition stores C by masked stores of the
    generic proxy (no TMA store there), staged through its C tile in shared memory (a
    barrier between), 16 bytes a store on aligned operands; then a barrier of its 256
    threads, then one thread's release add at GPU scope on the tile's post flag; the loader
    waits on nothing. Without a C tile in shared memory (``tma_epilogue=False``) the stores
    go from registers, one barrier. Without posts no release add at all."""
    k = _build(has_wait=False, post=True, dynamic=True, clip=True, aligned=True)
    mma, loader = _regions(k)
    assert "atomic_rmw add, release, gpu" in mma and "atomic_rmw add, release" not in loader
    assert "async_tma_copy_local_to_global" not in mma and _barriers(mma) == 2
    staged = [ln for ln in mma.splitlines() if "ttg.local_load" in ln and "tensor<128x256xbf16" in ln]
    assert len(staged) == 1, staged  # (the C tile read back from shared memory)
    assert "atomic_rmw add, acquire" not in loader and "globaltimer" not in loader
    ptx = k.asm["ptx"]
    # (Triton 3.9 posts with red, 3.6 with atom; the same release add)
    post = re.search(r"(red|atom)\.global\.gpu\.release\.add\.u32", ptx).start()
    before = ptx[:post]
    assert before.rfind("bar.sync \t0, 256") > before.rfind("st.global"), "no barrier of the MMA warps between " \
        "their last store and the post"
    stores = re.findall(r"st\.global\.[\w.]+", ptx)
    assert stores and set(stores) == {"st.global.v4.b32"}, sorted(set(stores))  # (16-byte stores only)
    regs = _build(has_wait=False, post=True, dynamic=True, clip=True, aligned=True, tma_c=False, stages=4)
    mma_r = _regions(regs)[0]
    assert _barriers(mma_r) == 1 and "tensor<128x256xbf16" not in \
        "".join(ln for ln in mma_r.splitlines() if "ttg.local_load" in ln)
    assert re.search(r"(red|atom)\.global\.gpu\.release\.add\.u32", regs.asm["ptx"])
    assert "st.global.v4.b32" not in regs.asm["ptx"]  # (from the MMA layout: 4 bytes a store at most)
    plain = _build(has_wait=False, dynamic=True, clip=True)
    assert "atomic_rmw add, release" not in plain.asm["ttgir"] and _barriers(_regions(plain)[0]) == 0
    assert "async_tma_copy_local_to_global" in _regions(plain)[0]


def test_post_plan_refuses_what_cannot_post() -> None:
    """Posts take the plain kernel, flags and no error word (a tile that posts does not wait)."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    a, w, c = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(256, 128, dtype=torch.bfloat16), \
        torch.zeros(256, 256, dtype=torch.bfloat16)
    tab, flags, err = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), \
        torch.zeros(8, dtype=torch.int32)
    for cfg, kw in ((GluonGemmConfig(block_m=128, block_n=128, stages=5, pingpong=True), dict(flags=flags)),
                    (GluonGemmConfig(block_m=128, block_n=192, stages=4), dict(flags=flags)),
                    (GluonGemmConfig(), dict()), (GluonGemmConfig(), dict(flags=flags, err=err))):
        with pytest.raises(ValueError, match="posts"):
            GluonGemmPlan(a, w.t(), c, tab, config=cfg, post=True, **kw)
    plan = GluonGemmPlan(a, w.t(), c, tab, flags=flags, post=True)
    assert plan.flags is flags and plan.prepared.constexprs["POST"] is True
    assert plan.prepared.constexprs["HAS_WAIT"] is False


def test_sm90_register_epilogue_leaves_room_for_a_fourth_slot() -> None:
    """``tma_epilogue=False``: no C tile in shared memory and no TMA store; C by masked
    stores (NaN over a skipped tile as with TMA); 128x256x64 then fits four ring slots."""
    k = _build(stages=4, tma_c=False)
    mma, loader = _regions(k)
    assert "async_tma_copy_local_to_global" not in mma and "warp_group_dot " in mma
    assert "dense<0x7FC0>" in k.asm["ttgir"]  # the poison store is still there
    assert 4 * (128 + 256) * 64 * 2 <= k.metadata.shared <= 227 * 1024, k.metadata.shared
    assert _build().metadata.shared > k.metadata.shared  # (3 slots and the C tile: 208 KiB, 4 slots: 192)
    cfg = GluonGemmConfig(stages=4, tma_epilogue=False)
    assert cfg.smem_bytes(2) == 4 * (128 + 256) * 64 * 2 + 16 * 4 + 1024
    with pytest.raises(ValueError, match="227 KiB"):
        GluonGemmConfig(stages=4)
    for bad in (dict(block_m=128, block_n=128, pingpong=True, stages=5), dict(block_n=192, stages=4)):
        with pytest.raises(ValueError, match="tma_epilogue"):
            GluonGemmConfig(tma_epilogue=False, **bad)


def test_split_plan_fills_the_last_wave() -> None:
    """``split_plan``: the last wave's tiles in q or q + 1 K slices, as many as programs;
    nothing split where the wave is full or more than half full or K too short."""
    from overlap.kernels.gluon_gemm import SPLIT_MIN_STEPS, split_plan

    assert split_plan(288, 132, 96) == (264, 5, 12, 264 + 24 * 5 + 12)  # 1024x9216 of 128x256: 2.2 waves
    assert split_plan(48, 132, 64) == (0, 2, 36, 132)  # one partial wave: 36 tiles in 3, 12 in 2
    assert split_plan(32, 30, 16) == (30, 4, 0, 38)  # q capped by K: 16 steps, 4 a slice
    for none in ((264, 132, 96), (100, 132, 96), (32, 12, 16), (48, 132, 7), (0, 132, 8), (5, 0, 8)):
        assert split_plan(*none) is None, none
    for tiles in range(1, 400, 7):
        for grid in (8, 77, 132):
            for k_tiles in (4, 9, 64):
                sp = split_plan(tiles, grid, k_tiles)
                if sp is None:
                    continue
                start, q, r, units = sp
                tail = tiles - start
                assert start % grid == 0 and 0 < tail <= grid // 2 and q >= 2 and 0 <= r < tail
                assert units - start == tail * q + r <= grid
                assert k_tiles // (q + (r > 0)) >= SPLIT_MIN_STEPS


def test_split_tail_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="split_tail"):
        GluonGemmConfig(block_m=128, block_n=128, stages=5, pingpong=True, split_tail=True)
    with pytest.raises(ValueError, match="split_tail"):
        GluonGemmConfig(split_tail=True, ahead=True)
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels.gluon_gemm import launch_gluon_gemm

    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(128, 256, dtype=torch.bfloat16)
    c = torch.zeros(256, 256, dtype=torch.bfloat16)
    tab = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="one GluonGemmPlan"):
        launch_gluon_gemm(a, b, c, tab, grid=1, counter=torch.zeros(1, dtype=torch.int32),
                          config=GluonGemmConfig(split_tail=True))
    with pytest.raises(ValueError, match="does not post"):
        from overlap.kernels.gluon_gemm import GluonGemmPlan

        GluonGemmPlan(a, b, c, tab, flags=torch.zeros(4, dtype=torch.int32), post=True,
                      config=GluonGemmConfig(split_tail=True))


def test_sm90_split_tail_slices_meet_in_the_workspace() -> None:
    """``split_tail``: the MMA warps store a slice's partial, then (after a barrier of their
    threads) one acq_rel add to the tile's arrival count, and the last slice reads the others'
    partials past L1; the loader's K loop starts at the slice's first step. Without it none
    of that is in the kernel."""
    k = _build(split=True)
    mma, loader = _regions(k)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1, "one arrival add"
    assert "ld.global.cg" in ptx
    at = mma.index("tt.atomic_rmw")
    assert "acq_rel" in mma[at:at + 200]
    assert _barriers(mma[:at][-3000:]) >= 1, "a barrier of the MMA warps before the arrival"
    assert "fence.acq_rel.gpu" in mma[:at][-3000:], "every thread's fence before it"
    assert "acq_rel" not in loader
    for kw in (dict(), dict(dynamic=True)):
        plain = _build(**kw).asm["ptx"]
        assert "acq_rel" not in plain and "ld.global.cg" not in plain, kw
    assert "acq_rel" in _build(split=True, dynamic=True).asm["ptx"]


def _split_operands() -> tuple:
    """A, B (= w.t()), C of 1024 x 1024 x 1024 and a table of its 32 tiles of 128x256."""
    a, w, c = (torch.zeros(1024, 1024, dtype=torch.bfloat16) for _ in range(3))
    return a, w.t(), c, torch.zeros(32, 8, dtype=torch.int32)


def test_plan_workspace_argument_is_fp32_split_or_not() -> None:
    """The workspace pointer is fp32 in every launch of the plain kernel, split or not: the
    kernel is compiled for the pointer's type, and plans of one key share the compiled
    kernel (a first launch without a split compiled an int32 workspace, which a later
    split plan of the same key then stored its partials through, truncated). The split,
    fixed by a plan's first launch, is the same for later grids; no split: the table's
    tiles whole."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    a, b, c, tab = _split_operands()
    for split, grid, want in ((False, 30, None), (True, 9, None), (True, 30, (30, 4, 0, 38))):
        plan = GluonGemmPlan(a, b, c, tab, config=GluonGemmConfig(split_tail=split))
        got: list = []

        class Prepared:
            raw = None

            def launch(self, nprog, args, aligned=()) -> None:  # noqa: ANN001
                got.append((nprog, args))

        plan.prepared = Prepared()
        for g in (grid, 100, 5):
            plan.launch(a, b, c, epoch=1, grid=g)
        for (nprog, args), g in zip(got, (grid, 100, 5)):
            ws, sk, units, start, q, r = args[9], args[10], *args[-4:]
            assert ws.dtype == torch.float32 and sk.dtype == torch.int32, (split, ws.dtype, sk.dtype)
            if want is None:
                assert (units, start, q, r) == (32, 32, 1, 0) and nprog == min(g, 32)
            else:
                assert (start, q, r, units) == want and nprog == min(g, 38), (split, g, args[-4:])
                assert ws.numel() == 8 * 128 * 256 and sk.numel() == 2 and not sk.any()


def test_plan_first_launch_in_a_capture_splits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split plan whose first launch is captured in a CUDA graph stays unsplit for good:
    the arrival counts' zeroing would only be recorded there, and an eager launch before
    the graph's first replay would read them unset."""
    if not compat.AVAILABLE:
        pytest.skip(compat.REASON)
    from overlap.kernels import gluon_gemm as gg
    from overlap.kernels.gluon_gemm import GluonGemmPlan

    a, b, c, tab = _split_operands()
    for capturing, want in ((True, None), (False, (30, 4, 0, 38))):
        plan = GluonGemmPlan(a, b, c, tab, config=GluonGemmConfig(split_tail=True))
        monkeypatch.setattr(gg, "_capturing", lambda device: capturing)
        got = plan._split_args(30)
        assert plan.split[1] == want, (capturing, plan.split[1])
        assert got[2:] == ((32, 32, 1, 0) if want is None else (38, 30, 4, 0)) and got[0].dtype == torch.float32
        monkeypatch.setattr(gg, "_capturing", lambda device: False)  # (fixed: the later eager launches alike)
        assert plan._split_args(30)[2:] == got[2:]


def _unit_as_the_kernel(u: int, start: int, q: int, r: int, k_tiles: int) -> tuple:
    """``gluon_gemm._unit``'s arithmetic, step for step (Triton's integer ``//`` truncates; all
    operands here are non-negative)."""
    if u < start:
        return u, 0, k_tiles, -1, 1, 0, 0
    v = u - start
    big = r * (q + 1)
    if v < big:
        i, n, base = v // (q + 1), q + 1, v // (q + 1) * (q + 1)
    else:
        i = r + (v - big) // q
        n, base = q, big + (i - r) * q
    s = v - base
    return start + i, s * k_tiles // n, (s + 1) * k_tiles // n, i, n, base, s


def test_units_cover_every_tile_and_k_step_once() -> None:
    """Over ``split_plan``'s units, each tile's K steps are covered once, whole tiles by one
    unit, tail tiles by their slices in order, each slice its own workspace slot."""
    from overlap.kernels.gluon_gemm import SPLIT_MIN_STEPS, split_plan

    seen = 0
    for tiles in (1, 7, 48, 131, 140, 288, 300, 961):
        for grid in (4, 30, 77, 132):
            for k_tiles in (8, 33, 96):
                sp = split_plan(tiles, grid, k_tiles)
                if sp is None:
                    continue
                start, q, r, units = sp
                steps: dict[int, list] = {}
                slots = set()
                for u in range(units):
                    tile, k0, k1, i, n, base, s = _unit_as_the_kernel(u, start, q, r, k_tiles)
                    steps.setdefault(tile, []).append((k0, k1))
                    if u >= start:
                        assert k1 - k0 >= SPLIT_MIN_STEPS and 0 <= i < tiles - start and 0 <= s < n
                        assert base + s == u - start and base + s not in slots
                        slots.add(base + s)
                assert sorted(steps) == list(range(tiles))
                for tile, parts in steps.items():
                    assert parts[0][0] == 0 and parts[-1][1] == k_tiles
                    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (tile, parts)
                seen += 1
    assert seen > 20
