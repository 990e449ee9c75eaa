"""overlap.kernels._launch.CachedLauncher with a fake Triton function (no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from overlap.kernels import _launch

_real_hooks = _launch._hooks  # before the fixture below replaces it


class FakeCompiled:
    def __init__(self, log: list, fail_run: bool = False) -> None:
        self.log = log
        self.fail_run = fail_run
        self.function = "fn-handle"
        self.packed_metadata = "packed"

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)

    def run(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        if self.fail_run:
            raise TypeError("run() takes other arguments")
        self.log.append(("fast", gx, stream, function, packed, args))
        self.hooks = (meta, enter, leave)


class FakeJit:
    """Signature (a, b, N, BLOCK: constexpr, FLAG: constexpr)."""

    def __init__(self, fail_run: bool = False) -> None:
        self.log: list = []
        self.fail_run = fail_run
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in
                       (("a", False), ("b", False), ("N", False), ("BLOCK", True), ("FLAG", True))]

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("jit", grid[0], args, kw))
            return FakeCompiled(self.log, self.fail_run)
        return call


class Ptr:
    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 1234 + device)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_hooks", lambda: (None, None))


def test_second_launch_takes_the_compiled_kernel_with_constexprs_last():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    a, b = Ptr(256), Ptr(512)
    lc.launch(4, (a, b, 64), {"BLOCK": 128, "FLAG": True}, key=("k", 64), num_warps=8, num_stages=3, aligned=(a, b))
    lc.launch(6, (a, b, 64), {"BLOCK": 128, "FLAG": True}, key=("k", 64), num_warps=8, num_stages=3, aligned=(a, b))
    assert [e[0] for e in fn.log] == ["jit", "fast"]
    assert fn.log[0][3] == {"BLOCK": 128, "FLAG": True, "num_warps": 8, "num_stages": 3}
    # grid, the current stream, the compiled handle, then args in signature order
    assert fn.log[1] == ("fast", 6, 1234, "fn-handle", "packed", (a, b, 64, 128, True))
    assert (lc.hits, lc.misses) == (1, 1)
    # no hook is set on the cached path: no launch metadata made, no hooks passed
    assert fn.log[1] and lc._cache[next(iter(lc._cache))].hooks == (None, None, None)


def test_another_key_options_or_device_compile_through_triton():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    base = dict(key=("k",), num_warps=8, num_stages=3, aligned=(a,))
    lc.launch(1, (a, a, 1), {"BLOCK": 64, "FLAG": False}, **base)
    lc.launch(1, (a, a, 1), {"BLOCK": 64, "FLAG": False}, **{**base, "key": ("other",)})
    lc.launch(1, (a, a, 1), {"BLOCK": 64, "FLAG": False}, **{**base, "num_warps": 4})
    lc.launch(1, (a, a, 1), {"BLOCK": 64, "FLAG": False}, **{**base, "device": 1})
    assert [e[0] for e in fn.log] == ["jit"] * 4
    lc.launch(1, (a, a, 1), {"BLOCK": 64, "FLAG": False}, **{**base, "device": 1})
    assert fn.log[-1][0] == "fast" and fn.log[-1][2] == 1235


def test_unaligned_pointer_or_interpreter_or_hooks_take_tritons_path(monkeypatch):
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    good, bad = Ptr(1024), Ptr(1030)
    kw = dict(key=("k",), num_warps=4)
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), **kw)
    lc.launch(1, (bad, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(bad,), **kw)
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), interpret=True, **kw)
    monkeypatch.setattr(_launch, "_hooks", lambda: (SimpleNamespace(calls=[print]), None))
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), **kw)
    assert [e[0] for e in fn.log] == ["jit"] * 4
    monkeypatch.setattr(_launch, "_hooks", lambda: (SimpleNamespace(calls=[]), None))  # empty chain: fast
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), **kw)
    assert fn.log[-1][0] == "fast"
    # the unaligned call's kernel was not cached over the aligned one
    assert lc.misses == 4 and len(lc._cache) == 1


def test_a_first_unaligned_call_is_not_cached():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    good, bad = Ptr(2048), Ptr(2052)
    kw = dict(key=("k",), num_warps=4)
    lc.launch(1, (bad, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(bad,), **kw)
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), **kw)
    lc.launch(1, (good, good, 2), {"BLOCK": 16, "FLAG": 0}, aligned=(good,), **kw)
    assert [e[0] for e in fn.log] == ["jit", "jit", "fast"]


def test_a_launcher_that_refuses_the_call_falls_back_for_good():
    fn = FakeJit(fail_run=True)
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    kw = dict(key=("k",), num_warps=4)
    lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, **kw)
    with pytest.warns(RuntimeWarning, match="cached kernel launch unavailable"):
        lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, **kw)
    lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, **kw)
    # the refused call and every later one went through Triton: nothing lost, nothing twice
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"]
    assert not lc.enabled


def test_constexprs_not_last_disable_the_cache():
    fn = FakeJit()
    fn.params = [SimpleNamespace(name="BLOCK", is_constexpr=True), SimpleNamespace(name="a", is_constexpr=False)]
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    for _ in range(2):
        lc.launch(1, (a,), {"BLOCK": 16}, key=("k",), num_warps=4)
    assert [e[0] for e in fn.log] == ["jit", "jit"]


def test_cache_is_bounded():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn, max_entries=2)
    a = Ptr(0)
    for k in (1, 2, 3, 1):
        lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, key=(k,), num_warps=4)
    assert len(lc._cache) == 2
    assert [e[0] for e in fn.log] == ["jit"] * 4  # key 1 was dropped when key 3 came


def test_real_kernels_have_constexprs_last():
    pytest.importorskip("triton")
    from overlap.kernels.add_norm import _add_norm_launcher, _reduce_launcher
    from overlap.kernels.tile_gemm import _launcher
    from overlap.kernels.words import _launcher as _words_launcher

    for lc in (_launcher, _reduce_launcher, _words_launcher, _add_norm_launcher):
        assert lc.enabled and lc.const_names, lc.fn


def test_an_integer_past_int32_is_another_kernel():
    """Triton types an unspecialized integer argument i32 or i64 by its value: a cached
    kernel compiled for an i32 must not be handed an i64 (a 5 s timeout in ns)."""
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    kw = dict(key=("k",), num_warps=4)
    lc.launch(1, (a, a, 500_000_000), {"BLOCK": 16, "FLAG": 0}, **kw)
    lc.launch(1, (a, a, 5_000_000_000), {"BLOCK": 16, "FLAG": 0}, **kw)
    lc.launch(1, (a, a, -5_000_000_000), {"BLOCK": 16, "FLAG": 0}, **kw)
    lc.launch(1, (a, a, 400_000_000), {"BLOCK": 16, "FLAG": 0}, **kw)
    lc.launch(1, (a, a, 6_000_000_000), {"BLOCK": 16, "FLAG": 0}, **kw)
    assert [e[0] for e in fn.log] == ["jit", "jit", "fast", "fast", "fast"]


def test_an_argument_the_cached_kernel_refuses_goes_through_triton_once():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    kw = dict(key=("k",), num_warps=4)
    lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, **kw)
    cached = lc._cache[next(iter(lc._cache))]

    def refuse(*args):
        raise OverflowError("signed integer is greater than maximum")
    cached.run = refuse
    lc.launch(1, (a, a, 2), {"BLOCK": 16, "FLAG": 0}, **kw)
    assert [e[0] for e in fn.log] == ["jit", "jit"] and lc.enabled
    assert lc._cache[next(iter(lc._cache))] is cached  # the refused call's kernel was not cached


def test_prepared_launch_goes_straight_to_the_compiled_kernel():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    a, b = Ptr(256), Ptr(512)
    pl = lc.prepare(("k", 64), {"BLOCK": 128, "FLAG": True}, num_warps=8, num_stages=3)
    pl.launch(4, (a, b, 64), aligned=(a, b))
    assert [e[0] for e in fn.log] == ["jit"] and pl.compiled is not None
    pl.launch(6, (b, a, 7), aligned=(a, b))
    assert fn.log[-1] == ("fast", 6, 1234, "fn-handle", "packed", (b, a, 7, 128, True))
    # no launch metadata and no hooks passed (none are set)
    assert pl.compiled.hooks == (None, None, None)
    # a plain launch with the same key and options shares the compiled kernel
    lc.launch(2, (a, b, 64), {"BLOCK": 128, "FLAG": True}, key=("k", 64), num_warps=8, num_stages=3)
    assert [e[0] for e in fn.log] == ["jit", "fast", "fast"] and lc.misses == 1


def test_prepared_launch_takes_the_cache_path_when_anything_differs(monkeypatch):
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    good, bad = Ptr(1024), Ptr(1030)
    pl = lc.prepare(("k",), {"BLOCK": 16, "FLAG": 0}, num_warps=4)
    pl.launch(1, (good, good, 2), aligned=(good,))
    pl.launch(1, (good, good, 2 ** 40), aligned=(good,))  # another width class: Triton compiles again
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    assert pl.widths == (True,)  # the plan follows the last compiled kernel
    pl.launch(1, (good, good, 2), aligned=(good,))  # back: the cache has it
    assert fn.log[-1][0] == "fast" and pl.widths == (False,)
    n = len(fn.log)
    pl.launch(1, (bad, good, 2), aligned=(bad,))  # unaligned: Triton's path, not cached
    assert fn.log[n][0] == "jit"
    monkeypatch.setattr(_launch, "_hooks", lambda: (SimpleNamespace(calls=[print]), None))
    pl.launch(1, (good, good, 2), aligned=(good,))  # a hook is set: Triton's path
    assert fn.log[-1][0] == "jit"
    monkeypatch.setattr(_launch, "_current_device", lambda: 1)
    monkeypatch.setattr(_launch, "_hooks", lambda: (None, None))
    pl.launch(1, (good, good, 2), aligned=(good,))  # another device: compiled for it
    assert fn.log[-1][0] == "jit" and pl.device == 1


def test_prepared_launch_refused_by_the_launcher_falls_back():
    fn = FakeJit(fail_run=True)
    lc = _launch.CachedLauncher(fn)
    a = Ptr(0)
    pl = lc.prepare(("k",), {"BLOCK": 16, "FLAG": 0}, num_warps=4)
    pl.launch(1, (a, a, 2))
    with pytest.warns(RuntimeWarning, match="cached kernel launch unavailable"):
        pl.launch(1, (a, a, 2))
    pl.launch(1, (a, a, 2))
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"] and not lc.enabled


def test_a_new_row_count_keeps_the_tile_gemm_key():
    """Triton specializes a tensor descriptor on its dtype and block shape only, so the
    tile GEMM's launch key leaves the row counts of A and A2 out (a new M reuses the
    compiled kernel); everything else it is keyed on still changes it."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.tools.tensor_descriptor import TensorDescriptor

    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, _key, _meta

    specs = set()
    for m in (1, 16, 17, 8191):
        t = torch.empty(m, 64, dtype=torch.bfloat16)
        specs.add(native_specialize_impl(BaseBackend, TensorDescriptor(t, t.shape, t.stride(), [128, 64]),
                                         False, True, True)[0])
    assert len(specs) == 1, specs  # what the key relies on

    def key(m: int, k: int = 64, n: int = 128) -> tuple:
        a, a2 = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(2 * m, k, dtype=torch.bfloat16)
        b, c = torch.empty(k, n, dtype=torch.bfloat16), torch.empty(2 * m, n, dtype=torch.bfloat16)
        t = torch.empty(4, 8, dtype=torch.int32)
        meta = _meta(DEFAULT_CONFIG, a, a2, True, True, False, None, False, None, None, 0)
        return _key(meta, a, a2, b, c, t, t, t, t)

    assert key(7) == key(4096) == key(1)
    assert key(7, k=128) != key(7) and key(7, n=256) != key(7)


def test_hooks_read_live_from_tritons_knobs(monkeypatch):
    """The knobs module is looked up once; the hooks themselves on every launch (a profiler
    that sets one later turns the cached path off from its next launch)."""
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(_launch, "_runtime_knobs", None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    assert _real_hooks() == (None, None)

    def hook(*a):
        return None

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    assert _real_hooks() == (hook, None) and _launch._runtime_knobs is knobs.runtime


def test_tile_gemm_plan_checks_its_own_tensors_once():
    """A plan checks the alignment of its own tensors (table, flags, error word, counter,
    workspace) when made; a launch asks the cached path to check only the C it brings,
    unless one of the plan's own is unaligned (then all, and Triton's path takes it)."""
    import torch

    from overlap.kernels.tile_gemm import TileGemmPlan
    from tests.kernels._interp_common import CFG, Segment, _table

    m, n, k = 64, 48, 32
    table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, CFG)
    a, w = torch.randn(m, k, dtype=torch.float16), torch.randn(n, k, dtype=torch.float16)
    c = torch.empty(m, n, dtype=torch.float16)
    buf, err = torch.zeros(16, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    for flags, aligned in ((buf[:4], True), (buf[1:5], False)):
        plan = TileGemmPlan(a, w.t(), c, table, flags=flags, err=err, config=CFG, wait=True)
        got: list = []
        plan.prepared = SimpleNamespace(launch=lambda nprog, args, aligned=(): got.append(aligned))
        plan.launch((0, 0, 0), c, epoch=1, grid=2)
        assert plan.own_aligned is aligned
        ptrs = [t.data_ptr() for t in got[0]]
        assert ptrs == [c.data_ptr()] if aligned else flags.data_ptr() in ptrs and c.data_ptr() in ptrs


# ---- the C launcher called with descriptors filled once (Triton 3.6's launcher form) ----

class _Launcher36:
    """A compiled kernel's ``run`` of the form ``_RawLaunch.of`` recognizes: ``launch`` is a
    wrapper whose closure holds the C launcher, the descriptor indices and their metadata,
    and fills every descriptor on every call."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, launcher, tensordesc_indices, tensordesc_meta, fill):
        def inner(*args):
            out = list(args[:13])
            j = 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    m = tensordesc_meta[j]
                    j += 1
                    out += [fill(arg.base.data_ptr(), m["swizzle"], m["elem_size"], m["elem_type"], m["block_size"],
                                 arg.shape, arg.strides, 0), *arg.shape, *arg.strides]
                else:
                    out.append(arg)
            return launcher(*out)
        self.launch = inner

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class FakeJit36(FakeJit):
    """Signature (a_desc, c, N, BLOCK: constexpr, FLAG: constexpr); a_desc a TMA descriptor."""

    def __init__(self, fills: list, c_calls: list) -> None:
        super().__init__()
        self.params[0].name = "a_desc"

        def fill(*a):
            fills.append(a)
            return ("map", a[0], tuple(a[5]), tuple(a[6]))

        self.fill = fill
        meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [64, 32], "fp4_padded": False}]
        self.run = _Launcher36(lambda *a: c_calls.append(a), {0}, meta, fill)

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("jit", grid[0], args, kw))
            return SimpleNamespace(run=self.run, function="fn-handle", packed_metadata="packed")
        return call


@pytest.fixture
def driver36(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("fake_driver36")
    mod._BASE_ARGS_FORMAT_LEN = 13
    mod.TMA_DTYPE_DEVICE_TO_HOST = {i: i for i in range(16)}
    monkeypatch.setitem(sys.modules, "fake_driver36", mod)
    monkeypatch.setattr(_Launcher36, "__module__", "fake_driver36")
    fills: list = []
    c_calls: list = []
    fn = FakeJit36(fills, c_calls)
    monkeypatch.setattr(_launch, "_fill_tma", lambda: fn.fill)
    return fn, fills, c_calls


def test_raw_launch_fills_a_descriptor_once_per_pointer_and_matches_the_wrapper(driver36):
    import torch

    fn, fills, c_calls = driver36
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("k",), {"BLOCK": 64, "FLAG": True}, num_warps=4)
    x = torch.zeros(128, 64, dtype=torch.float16)
    y = torch.zeros(128, 64, dtype=torch.float16)  # same geometry, another address
    c = torch.zeros(4, dtype=torch.int32)

    def desc(t):
        return _launch.HostDesc(t, t.shape, t.stride(), [64, 32])

    pl.launch(2, (desc(x), c, 7))  # Triton's path (compiles); the raw launcher is found
    assert pl.raw is not None
    before = len(c_calls)
    pl.compiled.run(3, 1, 1, 1234, "fn-handle", "packed", None, None, None, desc(x).triton(), c, 7, 64, True)
    wrapper_args = c_calls[before]  # what Triton's wrapper hands the C launcher
    pl.launch(3, (desc(x), c, 7))
    assert c_calls[-1] == wrapper_args  # the same arguments, in the same order
    n = len(fills)
    pl.launch(3, (desc(x), c, 7))
    assert len(fills) == n  # filled once for this pointer and geometry
    pl.launch(3, (desc(y), c, 7))
    assert len(fills) == n + 1 and c_calls[-1][13][1] == y.data_ptr()  # a new pointer: a new descriptor
    pl.launch(3, (desc(x[:64]), c, 7))  # same pointer, fewer rows: a new descriptor
    assert len(fills) == n + 2 and c_calls[-1][13][2] == (64, 64)
    assert [e[0] for e in fn.log] == ["jit"]  # every launch after the first took the raw launcher


def test_raw_launch_refuses_an_unaligned_descriptor_as_triton_does(driver36):
    import torch

    fn, fills, c_calls = driver36
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("k",), {"BLOCK": 64, "FLAG": True}, num_warps=4)
    x = torch.zeros(4096, dtype=torch.float16)
    good, bad = x[:2048].view(32, 64), x[1:2049].view(32, 64)
    c = torch.zeros(4, dtype=torch.int32)
    pl.launch(1, (_launch.HostDesc(good, good.shape, good.stride(), [64, 32]), c, 7))
    n = len(c_calls)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        pl.launch(1, (_launch.HostDesc(bad, bad.shape, bad.stride(), [64, 32]), c, 7))
    assert len(c_calls) == n  # nothing launched


def test_another_launcher_form_takes_compiled_run():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("k",), {"BLOCK": 128, "FLAG": True}, num_warps=8)
    a = Ptr(256)
    pl.launch(1, (a, a, 3))
    assert pl.raw is None
    pl.launch(1, (a, a, 3))
    assert [e[0] for e in fn.log] == ["jit", "fast"]


def test_raw_launch_without_descriptors_calls_the_c_launcher(driver36, capsys):
    fn, fills, c_calls = driver36
    # Triton 3.6 keeps the C launcher itself where no argument is a descriptor: a builtin
    # (``print`` stands in for it here and shows what it was handed)
    fn.run.launch = print
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("k",), {"BLOCK": 64, "FLAG": True}, num_warps=4)
    a = Ptr(256)
    pl.launch(2, (a, a, 7))  # through Triton (compiles)
    assert pl.raw is not None and pl.raw.descs == ()
    capsys.readouterr()
    pl.launch(5, (a, a, 9))
    got = capsys.readouterr().out.split()
    # grid, stream, function, cooperative, PDL, two scratches, packed metadata, launch
    # metadata and hooks (None), then the arguments and constexprs
    assert got[:13] == ["5", "1", "1", "1234", "fn-handle", "False", "False", "None", "None", "packed",
                        "None", "None", "None"]
    assert got[-3:] == ["9", "64", "True"]
    assert [e[0] for e in fn.log] == ["jit"]


def test_prepared_launches_are_kept_per_key_and_options():
    fn = FakeJit()
    lc = _launch.CachedLauncher(fn, max_entries=2)
    a = Ptr(256)
    p1 = lc.prepared(("k", 1), {"BLOCK": 16, "FLAG": 0}, num_warps=4)
    assert lc.prepared(("k", 1), {"BLOCK": 16, "FLAG": 0}, num_warps=4) is p1
    p2 = lc.prepared(("k", 1), {"BLOCK": 16, "FLAG": 0}, num_warps=8)  # other options: another
    p3 = lc.prepared(("k", 2), {"BLOCK": 32, "FLAG": 1}, num_warps=4)
    assert len({id(p1), id(p2), id(p3)}) == 3 and len(lc._prepared) == 2  # bounded
    p3.launch(1, (a, a, 5))
    p3.launch(1, (a, a, 6))
    assert [e[0] for e in fn.log] == ["jit", "fast"] and fn.log[1][-1] == (a, a, 6, 32, 1)


def test_cached_launch_takes_the_raw_launcher_with_new_descriptors_per_pointer(driver36):
    import torch

    fn, fills, c_calls = driver36
    lc = _launch.CachedLauncher(fn)
    c = torch.zeros(4, dtype=torch.int32)
    xs = [torch.zeros(64, 64, dtype=torch.float16) for _ in range(2)]

    def go(x):
        lc.launch(3, (_launch.HostDesc(x, x.shape, x.stride(), [64, 32]), c, 5), {"BLOCK": 64, "FLAG": True},
                  key=("k",), num_warps=4, aligned=(c,))

    go(xs[0])  # Triton's path: a TensorDescriptor made of the HostDesc
    assert type(fn.log[0][2][0]).__name__ == "TensorDescriptor"
    for x in (xs[0], xs[1], xs[0]):
        go(x)
        assert c_calls[-1][13][1] == x.data_ptr()  # this call's pointer, never the last one's
    assert len(fills) == 2 and [e[0] for e in fn.log] == ["jit"] and lc.hits == 3


def test_bound_launch_takes_each_calls_pointers_and_matches_the_wrapper(driver36):
    """A bound launch (a call plan's) hands the C launcher what Triton's wrapper would for
    the same arguments, and each call's own storage: a descriptor filled for the call's
    pointer (never the last call's), the call's tensor in its slot, the stream given."""
    import torch

    fn, fills, c_calls = driver36
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("k",), {"BLOCK": 64, "FLAG": True}, num_warps=4)
    x0, c0 = torch.zeros(128, 64, dtype=torch.float16), torch.zeros(4, dtype=torch.int32)

    def desc(t):
        return _launch.HostDesc(t, t.shape, t.stride(), [64, 32])

    assert _launch.BoundLaunch.of(pl, 3, (desc(x0), c0, 7), (x0, c0)) is None  # not compiled yet
    pl.launch(3, (desc(x0), c0, 7))  # Triton's path (compiles); the raw launcher is found
    d0 = desc(x0)
    bl = _launch.BoundLaunch.of(pl, 3, (d0, c0, 7), (x0, c0))
    assert bl is not None and len(bl.slots) == 2, bl
    assert not any(v is x0 or v is c0 for v in bl.tmpl)  # nothing of the binding call's storage is kept
    for i in range(4):  # new tensors every call: new pointers
        x, c = torch.randn(128, 64).half(), torch.zeros(4, dtype=torch.int32)
        pl.compiled.run(3, 1, 1, 99 + i, "fn-handle", "packed", None, None, None, desc(x).triton(), c, 7, 64, True)
        want = c_calls[-1]  # what Triton's wrapper hands the C launcher for this call
        bl(99 + i, (x, c))
        got = c_calls[-1]
        assert got == want, (i, got, want)
        assert got[13][1] == x.data_ptr() and got[-4] is c
    # a descriptor of a tensor the call does not give is not bound
    assert _launch.BoundLaunch.of(pl, 3, (d0, c0, 7), (c0,)) is None
    with pytest.raises(ValueError, match="16-byte"):  # an unaligned pointer: refused, nothing launched
        n = len(c_calls)
        bad = torch.zeros(128 * 64 + 1, dtype=torch.float16)[1:].view(128, 64)
        bl(1, (bad, c0))
    assert len(c_calls) == n


def test_bound_launch_refuses_a_tensor_in_two_roles_and_maps_placeholders_by_position(driver36):
    """A binding call that gives one tensor in two roles (``all_gather_matmul(x, x)``: A's
    descriptor and B's) is not bound: a later call's distinct tensors would fill both roles
    from the first. With ``positional`` (add+norm: ``h`` stands in for absent tensors) each
    argument keeps its own slot, so a later call's second tensor reaches the second slot."""
    import torch

    fn, fills, c_calls = driver36
    lc = _launch.CachedLauncher(fn)
    pl = lc.prepare(("alias",), {"BLOCK": 64, "FLAG": True}, num_warps=4)
    x0 = torch.zeros(128, 64, dtype=torch.float16)

    def desc(t):
        return _launch.HostDesc(t, t.shape, t.stride(), [64, 32])

    pl.launch(3, (desc(x0), x0, 7))
    assert _launch.BoundLaunch.of(pl, 3, (desc(x0), x0, 7), (x0, x0)) is None
    bl = _launch.BoundLaunch.of(pl, 3, (desc(x0), x0, 7), (x0, x0), positional=True)
    assert bl is not None
    x, other = torch.randn(128, 64).half(), torch.randn(128, 64).half()
    bl(1, (x, other))
    got = c_calls[-1]
    assert any(v is other for v in got) and not any(v is x for v in got), \
        "the plain slot takes the call's second tensor (the first only fills the descriptor)"
    assert got[13][1] == x.data_ptr(), "the descriptor filled for the call's first tensor"


def test_nccl_bound_checks_each_collectives_sizes() -> None:
    """``NcclCommunicator.bound``'s size check: right sizes pass it (the CPU tensors then
    stop at the CUDA check), wrong ones name the sizes. A reduce-scatter's recv is send / R."""
    import torch

    from overlap._nccl import NcclCommunicator

    c = NcclCommunicator.__new__(NcclCommunicator)
    c.nranks = 2
    for kind, s, r in (("all_gather", 4, 8), ("all_reduce", 8, 8), ("reduce_scatter", 8, 4)):
        with pytest.raises(ValueError, match="CUDA tensor"):
            c.bound(kind, torch.zeros(s), torch.zeros(r), None)
    for kind, s, r in (("all_gather", 4, 4), ("all_reduce", 8, 4), ("reduce_scatter", 8, 8)):
        with pytest.raises(ValueError, match="elements"):
            c.bound(kind, torch.zeros(s), torch.zeros(r), None)
