"""Launch a Triton kernel again without Triton's per-call argument binding.

Triton's ``kernel[grid](...)`` binds and specializes every argument on every call
(type, 16-byte alignment of pointers, divisibility of integers), hashes the result
and looks the compiled kernel up: tens of microseconds of host time per launch,
which is the whole budget of a small overlapped op. ``CachedLauncher`` does that
once per *key* the caller gives and then calls the compiled kernel's own launcher
(``CompiledKernel.run``, the call Triton's ``JITFunction.run`` ends in).

The caller's key must determine Triton's specialization: every constexpr, the
launch options, the dtypes, and the integer arguments Triton specializes on
(those not in ``do_not_specialize``), by value. The width class of every integer
argument (int32 or wider: Triton types even unspecialized integers by it) is
added here. Pointers are assumed 16-byte
aligned and tensor descriptors TMA-legal (the callers here check the second before
launching); a tensor in ``aligned`` that is not 16-byte aligned sends that call through
Triton's path, uncached.

Off under the interpreter and while Triton's launch hooks are set (a profiler
that wants them gets the normal path). If the compiled kernel's ``run`` does not
take the call (another Triton version), the launcher falls back to the normal
path for good, once, with a warning.

Host TMA descriptors: a plan's launches take ``HostDesc`` (a descriptor's fields, made
without Triton's per-object checks). Where the compiled kernel's launcher has the form
of Triton 3.6 (its Python wrapper fills each descriptor argument with
``fill_tma_descriptor`` on every launch, then calls the C launcher), a cached launch
(``PreparedLaunch``, and ``CachedLauncher``'s once its kernel is cached) calls the C
launcher itself with the descriptors filled once per (pointer, shape, strides) and kept
per compiled kernel (``_RawLaunch``): a filled descriptor holds only an address and a
geometry, so a tensor of the same address and geometry takes the same one exactly. Any
other launcher form gets ``TensorDescriptor`` objects through
``CompiledKernel.run``, as before.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

__all__ = ["CachedLauncher", "PreparedLaunch", "HostDesc", "BoundLaunch", "hooks_set"]


class HostDesc:
    """A host TMA descriptor's fields: ``base`` (a tensor), ``shape``, ``strides`` and
    ``block_shape``, with no checks of its own: its maker checked the layout once
    (``TileGemmPlan``), and a launch checks the pointer and the shape when it fills one
    (``_RawLaunch``) or Triton does (``triton()``)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "gluon")

    def __init__(self, base: Any, shape: Any, strides: Any, block_shape: Any, gluon: Any = None) -> None:
        self.base, self.shape, self.strides, self.block_shape = base, shape, strides, block_shape
        self.gluon = gluon
        """None, or ``f(base, block_shape)`` making the Gluon descriptor a Gluon kernel takes
        (its shared-memory layout in it) where Triton's own launch path is taken."""

    def triton(self) -> Any:
        """Triton's ``TensorDescriptor`` of the same fields (and its checks); a Gluon
        kernel's descriptor where ``gluon`` is given."""
        if self.gluon is not None:
            return self.gluon(self.base, self.block_shape)
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, self.shape, self.strides, self.block_shape)

    def __repr__(self) -> str:
        return f"HostDesc({tuple(self.shape)}, strides {tuple(self.strides)}, block {list(self.block_shape)})"


def _for_triton(args: Sequence[Any]) -> tuple:
    """``args`` with every ``HostDesc`` as Triton's ``TensorDescriptor``."""
    return tuple(v.triton() if type(v) is HostDesc else v for v in args)


_BASE_ARGS = 13
"""Arguments of Triton 3.6's C launcher before the kernel's own: grid (3), stream, function,
cooperative, PDL, global and profile scratch, packed metadata, launch metadata, two hooks."""

MAPS_CAP = 64
"""Filled descriptors a compiled kernel's ``_RawLaunch`` keeps (cleared when full)."""


def _fill_tma() -> Any:
    """Triton 3.6's ``fill_tma_descriptor`` (the C helper its launcher wrapper calls), or None."""
    try:
        import triton

        return triton.runtime.driver.active.utils.fill_tma_descriptor
    except Exception:  # noqa: BLE001 - another Triton, or no driver: its own path
        return None


class _RawLaunch:
    """Triton 3.6's C launcher of one compiled kernel, called with the descriptors filled
    once per (pointer, shape, strides): what its Python wrapper (``wrap_handle_tensordesc``)
    does on every launch, less the filling. ``of(k)`` returns None for any other form."""

    __slots__ = ("c_launch", "head", "descs", "fill", "dtypes", "maps")

    @staticmethod
    def of(k: Any) -> "_RawLaunch | None":
        import sys

        run = getattr(k, "run", None)
        wrapper = getattr(run, "launch", None)
        mod = sys.modules.get(type(run).__module__)
        if mod is None or getattr(mod, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_ARGS:
            return None
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None  # scratch is allocated per launch by the wrapper: keep it
        code = getattr(wrapper, "__code__", None)
        dtypes = getattr(mod, "TMA_DTYPE_DEVICE_TO_HOST", None)
        if code is None:
            if type(wrapper).__name__ != "builtin_function_or_method":
                return None
            c_launch, idx, meta = wrapper, set(), []  # no descriptor argument: the C launcher itself
        else:
            if wrapper.__closure__ is None:
                return None
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
            c_launch, idx, meta = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
        if c_launch is None or not isinstance(idx, (set, frozenset)) or not isinstance(meta, (list, tuple)) \
                or len(meta) != len(idx) or dtypes is None:
            return None
        if any(m is not None and (m.get("fp4_padded") or m.get("is_im2col")) for m in meta):
            return None
        fill = _fill_tma()
        if fill is None:
            return None
        raw = _RawLaunch()
        raw.c_launch, raw.fill, raw.dtypes = c_launch, fill, dtypes
        raw.head = (k.function, bool(run.launch_cooperative_grid), bool(run.launch_pdl), k.packed_metadata)
        raw.descs = tuple(zip(sorted(idx), meta))
        raw.maps = {}
        return raw

    def _expand(self, j: int, d: Any, meta: Any) -> list:
        if type(d) is not HostDesc:
            from triton.tools.tensor_descriptor import TensorDescriptor

            if not isinstance(d, TensorDescriptor) or d.padding != "zero" or getattr(d, "round_f32_to_tf32", False):
                raise TypeError("a descriptor argument of another kind")  # the caller's fallback
        if meta is None:  # lowered to a pointer and sizes: nothing to fill
            return [d.base, *d.shape, *d.strides, False, *d.shape, *d.strides]
        ptr = d.base.data_ptr()
        key = (j, ptr, tuple(d.shape), tuple(d.strides))
        m = self.maps.get(key)
        if m is None:
            if ptr % 16 or min(d.shape) <= 0:
                HostDesc.triton(d)  # Triton's check raises and names what is wrong
                raise ValueError(f"TMA descriptor of {tuple(d.shape)} at {ptr:#x}")
            if len(self.maps) >= MAPS_CAP:
                self.maps.clear()
            m = self.maps[key] = self.fill(ptr, meta["swizzle"], meta["elem_size"], self.dtypes[meta["elem_type"]],
                                           meta["block_size"], d.shape, d.strides, 0)
        return [m, *d.shape, *d.strides]

    def __call__(self, grid: int, stream: int, args: Sequence[Any], const_vals: tuple) -> None:
        function, coop, pdl, packed = self.head
        vals = (*args, *const_vals)
        out = [grid, 1, 1, stream, function, coop, pdl, None, None, packed, None, None, None]
        at = 0
        for j, (i, meta) in enumerate(self.descs):
            out.extend(vals[at:i])
            out.extend(self._expand(j, vals[i], meta))
            at = i + 1
        out.extend(vals[at:])
        self.c_launch(*out)


_runtime_knobs: Any = None  # triton.knobs.runtime, looked up on the first launch; False: none


def _hooks() -> tuple[Any, Any]:
    global _runtime_knobs
    rk = _runtime_knobs
    if rk is None:
        try:
            from triton import knobs

            rk = knobs.runtime
        except Exception:  # noqa: BLE001 - an older Triton without knobs: no fast path
            rk = False
        _runtime_knobs = rk
    if rk is False:
        return None, None
    return rk.launch_enter_hook, rk.launch_exit_hook


def _current_device() -> int:
    import torch

    # what ``torch.cuda.current_device()`` returns after its lazy-init check; a launch on
    # this path follows a compiled launch, so CUDA is initialized
    return torch._C._cuda_getDevice()


def _raw_stream(device: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(device)


def _hook_set(h: Any) -> bool:
    if h is None:
        return False
    calls = getattr(h, "calls", None)  # triton's HookChain
    return bool(calls) if calls is not None else True


def hooks_set() -> bool:
    """A Triton launch hook is set (a profiler wants Triton's own launch path)."""
    enter, leave = _hooks()
    return _hook_set(enter) or _hook_set(leave)


class CachedLauncher:
    """Launches of one ``@triton.jit`` function, the compiled kernel cached per key.

    ``args`` are the kernel's arguments in signature order with the constexprs
    left out; ``constexprs`` maps the constexpr names (which must all come after
    the other parameters) to their values."""

    def __init__(self, fn: Any, max_entries: int = 256) -> None:
        self.fn = fn
        self.max_entries = max_entries
        self.enabled = True
        self._cache: dict[Any, Any] = {}
        self._prepared: dict[Any, PreparedLaunch] = {}
        self._raws: dict[Any, _RawLaunch | None] = {}  # by the key of ``_cache``
        params = getattr(fn, "params", None)
        if params is not None:
            kinds = [bool(p.is_constexpr) for p in params]
            # constexprs must be a suffix of the signature: the compiled launcher then
            # takes the same values in the same order as the call below
            if True in kinds and False in kinds[kinds.index(True):]:
                self.enabled = False
            self.const_names = [p.name for p in params if p.is_constexpr]
        else:
            self.const_names = None
        self.hits = 0
        self.misses = 0

    def launch(self, grid: int, args: Sequence[Any], constexprs: dict[str, Any], *, key: Any,
               num_warps: int, num_stages: int | None = None, interpret: bool = False,
               device: int | None = None, aligned: Sequence[Any] = (), launch_pdl: bool = False,
               options: tuple[tuple[str, Any], ...] = ()) -> Any:
        """Launch; returns ``(compiled kernel, device, integer widths)`` when the compiled
        kernel is cached for this launch (for ``PreparedLaunch``), else None. ``launch_pdl``:
        Triton's option of that name (a programmatic dependent launch: another compiled kernel).
        ``options``: more compile options, as (name, value) pairs (``maxnreg``)."""
        opts: dict[str, Any] = {"num_warps": num_warps, **dict(options)}
        if num_stages is not None:
            opts["num_stages"] = num_stages
        if launch_pdl:
            opts["launch_pdl"] = True
        enter, leave = _hooks()
        fast = self.enabled and not interpret and not _hook_set(enter) and not _hook_set(leave)
        if fast and device is None:
            device = _current_device()  # Triton launches on the current device
        # Triton types every integer argument by its width (i32, i64, u64), even those it
        # does not specialize on: a value past int32 needs another compiled kernel
        widths = _widths(args)
        full_key = (key, widths, num_warps, num_stages, device, bool(launch_pdl), options)
        if fast:
            for t in aligned:
                if t.data_ptr() % 16:
                    # Triton compiles another kernel for it: take its path, and do not
                    # cache that kernel (later aligned calls keep the aligned one)
                    fast = False
                    break
        k = self._cache.get(full_key) if fast else None
        if k is not None:
            stream = _raw_stream(device)
            raw = self._raws.get(full_key)
            if raw is not None:
                try:
                    raw(grid, stream, args, tuple([constexprs[n] for n in self.const_names]))
                    self.hits += 1
                    return k, device, widths
                except (TypeError, OverflowError, ValueError):  # nothing was launched: the
                    self._raws[full_key] = None  # compiled kernel's own launcher from now on
            vals = (*_for_triton(args), *[constexprs[n] for n in self.const_names])
            try:
                # no hook is set on this path (``fast``): no launch metadata to make for one
                k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *vals)
                self.hits += 1
                return k, device, widths
            except TypeError as e:  # another Triton's launcher signature: nothing was launched
                self.enabled = False
                self._cache.clear()
                self._raws.clear()
                fast = False
                warnings.warn(f"overlap: cached kernel launch unavailable with this Triton ({e}); "
                              "using Triton's launch path", RuntimeWarning, stacklevel=3)
            except (OverflowError, ValueError):  # an argument the cached kernel cannot take
                fast = False  # (nothing was launched): Triton's path, and do not cache its pick
        # (a constexpr parameter named as an option, Gluon's num_warps, is passed once)
        compiled = self.fn[(grid,)](*_for_triton(args), **constexprs,
                                    **{k: v for k, v in opts.items() if k not in constexprs})
        self.misses += 1
        if fast and self.const_names is not None and hasattr(compiled, "run") and hasattr(compiled, "function"):
            if len(self._cache) >= self.max_entries:
                old = next(iter(self._cache))
                self._cache.pop(old)
                self._raws.pop(old, None)
            self._cache[full_key] = compiled
            self._raws[full_key] = _RawLaunch.of(compiled)
            return compiled, device, widths
        return None

    def prepare(self, key: Any, constexprs: dict[str, Any], *, num_warps: int, num_stages: int | None = None,
                interpret: bool = False, options: tuple[tuple[str, Any], ...] = ()) -> "PreparedLaunch":
        """Launches whose key, constexprs and options are fixed (see ``PreparedLaunch``)."""
        return PreparedLaunch(self, key, constexprs, num_warps, num_stages, interpret, options)

    def prepared(self, key: Any, constexprs: dict[str, Any], *, num_warps: int, num_stages: int | None = None,
                 interpret: bool = False) -> "PreparedLaunch":
        """``prepare``'s launches, one per (key, options), kept here (the most recent
        ``max_entries``): for a launcher function called per launch with a key that
        determines its constexprs (``launch_add_norm``, ``launch_gate``)."""
        k = (key, num_warps, num_stages, interpret)
        pl = self._prepared.get(k)
        if pl is None:
            if len(self._prepared) >= self.max_entries:
                self._prepared.pop(next(iter(self._prepared)))
            pl = self._prepared[k] = self.prepare(key, constexprs, num_warps=num_warps, num_stages=num_stages,
                                                  interpret=interpret)
        return pl


def _widths(args: Sequence[Any]) -> tuple[bool, ...]:
    return tuple([v > 0x7FFFFFFF or v < -0x80000000 for v in args if type(v) is int])  # a list: faster


class PreparedLaunch:
    """Launches of one kernel under a fixed key, constexprs and options (an op's plan).

    The first goes through ``CachedLauncher.launch``; later ones call the compiled
    kernel's launcher straight away, on the same device, with integer arguments of
    the same width classes and the ``aligned`` tensors 16-byte aligned, while no
    launch hook is set. They skip the cache's key lookup and Triton's launch
    metadata, and pass no hooks (none are set). Anything else takes the cache's path."""

    __slots__ = ("owner", "key", "constexprs", "num_warps", "num_stages", "interpret", "const_vals",
                 "compiled", "device", "widths", "raw", "options")

    def __init__(self, owner: CachedLauncher, key: Any, constexprs: dict[str, Any], num_warps: int,
                 num_stages: int | None, interpret: bool, options: tuple[tuple[str, Any], ...] = ()) -> None:
        self.owner, self.key, self.constexprs, self.options = owner, key, constexprs, options
        self.num_warps, self.num_stages, self.interpret = num_warps, num_stages, interpret
        names = owner.const_names or []
        self.const_vals = tuple(constexprs[n] for n in names)
        self.compiled: Any = None
        self.device: Any = None
        self.widths: Any = None
        self.raw: _RawLaunch | None = None

    def launch(self, grid: int, args: Sequence[Any], aligned: Sequence[Any] = ()) -> None:
        k = self.compiled
        if k is not None and self.owner.enabled:
            enter, leave = _hooks()
            if (not _hook_set(enter) and not _hook_set(leave) and _current_device() == self.device
                    and _widths(args) == self.widths and not any(t.data_ptr() % 16 for t in aligned)):
                raw = self.raw
                if raw is not None:
                    try:
                        raw(grid, _raw_stream(self.device), args, self.const_vals)
                        self.owner.hits += 1
                        return
                    except (TypeError, OverflowError, ValueError):  # nothing was launched: the
                        self.raw = None  # compiled kernel's own launcher from now on
                try:
                    k.run(grid, 1, 1, _raw_stream(self.device), k.function, k.packed_metadata, None, None, None,
                          *_for_triton(args), *self.const_vals)
                    self.owner.hits += 1
                    return
                except TypeError:  # another Triton's launcher signature: nothing was launched
                    self.compiled = None  # the cache's path below turns the fast path off with a warning
                except (OverflowError, ValueError):  # an argument the kernel cannot take: nothing launched
                    pass
        got = self.owner.launch(grid, _for_triton(args), self.constexprs, key=self.key, num_warps=self.num_warps,
                                num_stages=self.num_stages, interpret=self.interpret, aligned=aligned,
                                options=self.options)
        if got is not None:
            self.compiled, self.device, self.widths = got
            self.raw = _RawLaunch.of(got[0])


class BoundLaunch:
    """One prepared launch with every argument fixed but the storage of its tensors: a
    call plan's launch (``overlap.ops._calls``). Made from a launch's arguments once the
    kernel is compiled and its C launcher has Triton 3.6's form (``_RawLaunch``); ``of``
    returns None otherwise, and the caller keeps the general launch.

    The C launcher's argument list is built once, with the grid, the kernel's integers
    and constexprs in place; a call sets the stream, each tensor slot and each descriptor
    slot (its filled descriptor looked up by pointer: the shape and strides are the
    plan's, fixed) and calls the C launcher. The per-call guards of ``PreparedLaunch``
    are the caller's, once per call: no launch hook set, the current device the
    launch's (``hooks_set``, ``_current_device``). Every pointer is checked for 16-byte
    alignment where its descriptor is filled; a tensor slot's pointer by the caller."""

    __slots__ = ("c_launch", "tmpl", "slots", "maps", "fill", "device")

    @staticmethod
    def of(pl: "PreparedLaunch", grid: int, args: Sequence[Any], tensors: Sequence[Any], *,
           positional: bool = False) -> "BoundLaunch | None":
        """``args``: the launch's arguments as ``PreparedLaunch.launch`` takes them, whose
        descriptors (``HostDesc``) and tensors that are among ``tensors`` (by identity:
        a descriptor by its base) change per call; ``tensors`` in the order a call gives them.
        With ``positional`` the first ``len(tensors)`` arguments are ``tensors`` in that order
        (one object may fill several of them, as a placeholder). Without it, a tensor given
        in two roles is not bound (None): which role a later call's tensor fills would
        be a guess."""
        raw = pl.raw
        if raw is None or pl.compiled is None or not pl.owner.enabled or _widths(args) != pl.widths:
            return None
        if not positional:
            ids = [id(t) for t in tensors if t is not None]
            if len(ids) != len(set(ids)):
                return None
        function, coop, pdl, packed = raw.head
        vals = (*args, *pl.const_vals)
        out: list[Any] = [int(grid), 1, 1, 0, function, coop, pdl, None, None, packed, None, None, None]
        slots: list[tuple] = []

        def which(t: Any, k: int) -> int:
            """The index in ``tensors`` of argument ``k`` (``t``), or -1 (a constant)."""
            if positional:
                return k if k < len(tensors) and tensors[k] is t else -1
            for i, x in enumerate(tensors):
                if x is t:
                    return i
            return -1

        def plain(v: Any, k: int) -> None:
            if type(v) is HostDesc:
                raise TypeError("a descriptor outside the launcher's descriptor arguments")
            i = which(v, k) if hasattr(v, "data_ptr") else -1
            if i >= 0:
                slots.append(("t", len(out), i, None))
            out.append(v)

        at = 0
        for j, (i, meta) in enumerate(raw.descs):
            for k in range(at, i):
                plain(vals[k], k)
            d = vals[i]
            if type(d) is not HostDesc:
                return None
            src = which(d.base, i)
            if meta is None:  # lowered to a pointer and sizes
                if src >= 0:
                    slots.append(("t", len(out), src, None))
                out.extend([d.base, *d.shape, *d.strides, False, *d.shape, *d.strides])
            else:
                if src < 0:
                    return None  # a descriptor of a tensor the call does not give: not bound
                fill_args = (meta["swizzle"], meta["elem_size"], raw.dtypes[meta["elem_type"]], meta["block_size"],
                             tuple(d.shape), tuple(d.strides), 0)
                slots.append(("d", len(out), src, fill_args))
                out.extend([None, *d.shape, *d.strides])
            at = i + 1
        for k in range(at, len(vals)):
            plain(vals[k], k)
        for _, pos, _, _ in slots:
            out[pos] = None  # a call's own: the template keeps no tensor of the call that bound it
        bl = BoundLaunch()
        bl.c_launch, bl.fill, bl.device = raw.c_launch, raw.fill, pl.device
        bl.tmpl, bl.slots, bl.maps = out, tuple(slots), {}
        return bl

    def __call__(self, stream: int, tensors: Sequence[Any]) -> None:
        out = self.tmpl.copy()
        out[3] = stream
        maps = self.maps
        for kind, pos, src, fill_args in self.slots:
            t = tensors[src]
            if kind == "t":
                out[pos] = t
                continue
            ptr = t.data_ptr()
            m = maps.get((pos, ptr))
            if m is None:
                if ptr % 16:
                    raise ValueError(f"TMA descriptor of {fill_args[4]} at {ptr:#x}: not 16-byte aligned")
                if len(maps) >= MAPS_CAP:
                    maps.clear()
                m = maps[(pos, ptr)] = self.fill(ptr, *fill_args)
            out[pos] = m
        self.c_launch(*out)

    def __repr__(self) -> str:
        return f"BoundLaunch(grid {self.tmpl[0]}, {len(self.slots)} slots per call)"
