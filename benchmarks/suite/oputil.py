"""Small helpers the op modules share (all of them lazy about importing the library)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from .spec import Env, Variant

NEEDS_CUDA = "needs CUDA"
CPU_FALLBACK = "CPU: the public op falls back to its reference"

_symm_enabled: set[str] = set()


def describe_config(best: Any) -> Any:
    """A tuner's answer for the JSON: "sequential", "chunked xN" or the config's main fields."""
    if best is None or isinstance(best, str):
        return best
    if not hasattr(best, "gemm"):  # Sequential or Chunked: the label the results tables print
        return str(best)
    fields = ("transport", "chunks", "nccl_ctas", "reduce_ctas", "sm_margin", "give_back")
    out = {f: getattr(best, f) for f in fields if hasattr(best, f)}
    if getattr(best, "fold_norm", False):
        out["fold_norm"] = True
    if getattr(best, "two_shot", False):
        out["two_shot"] = True
    if getattr(best, "reduce_shared", False):
        out["reduce_shared"] = True
    if getattr(best, "split_tail", 0) > 1:
        out["split_tail"] = best.split_tail
    if getattr(getattr(best, "gemm", None), "warp_specialize", False):
        out["gemm_warp_specialized"] = True
    if out.get("transport") == "p2p":  # NCCL's CTA cap means nothing to the peer-copy path
        out.pop("nccl_ctas", None)
    return {k: v for k, v in out.items() if v is not None}


def fast_path_counter(fn: Callable[..., Any]) -> Callable[[], int] | None:
    """Reads ``stats["fused"]`` of the module ``fn`` lives in, when it keeps one."""
    stats = getattr(sys.modules.get(getattr(fn, "__module__", ""), None), "stats", None)
    if isinstance(stats, dict) and "fused" in stats:
        return lambda: int(stats["fused"])
    return None


def library_comm(env: Env) -> Any:
    """The library's NCCL communicator over the group (NCCL's default CTAs); CUDA only."""
    from overlap.ops._runtime import get_runtime

    return get_runtime(env.group, env.device).comm(None)


def raise_kernel_errors(env: Env) -> None:
    """Raise a flag-wait timeout any op of the library recorded on this runtime."""
    if not env.on_gpu:
        return
    from overlap.ops._runtime import get_runtime

    rt = get_runtime(env.group, env.device)
    for err in list(getattr(rt, "_errs", {}).values()):
        err.check(block=True)


def symm_mem_variant(env: Env, title: str, make: Callable[[str], Callable[[], Any]]) -> Variant:
    """torch's symmetric-memory op over the group: ``make(group_name)`` gives the call."""
    if not env.on_gpu:
        return Variant(title, role="external", na=NEEDS_CUDA)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = env.group.group_name
        if name not in _symm_enabled:
            symm_mem.enable_symm_mem_for_group(name)
            _symm_enabled.add(name)
        if not hasattr(torch.ops, "symm_mem"):
            raise RuntimeError("torch.ops.symm_mem is missing")
    except Exception as e:  # reported as n/a with the reason
        return Variant(title, role="external", na=f"symm_mem unavailable: {e!r}"[:300])
    return Variant(title, fn=make(name), role="external")


def torch_all_gather(env: Env, out: torch.Tensor, shard: torch.Tensor) -> Callable[[], Any]:
    from overlap.ops._runtime import all_gather_single

    return lambda: all_gather_single(out, shard, group=env.group)


def torch_all_reduce(env: Env, buf: torch.Tensor) -> Callable[[], Any]:
    return lambda: tdist.all_reduce(buf, group=env.group)


def tile_gemm_alone(env: Env, a: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
    """The library's tile GEMM ``a @ b`` alone over every SM, default config, no flags:
    tells the GEMM's own speed apart from what overlapping costs. CUDA only."""
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    m, n = a.shape[0], b.shape[1]
    rows = build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, DEFAULT_CONFIG.block_m,
                            DEFAULT_CONFIG.block_n)
    table = torch.tensor(rows, dtype=torch.int32, device=env.device)
    c = a.new_empty((m, n))
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    return lambda: launch_tile_gemm(a, b, c, table, grid=sms)


def p2p_push_alone(env: Env, src: torch.Tensor) -> Callable[[], Any] | None:
    """Copy-engine pushes of ``src`` into every peer's memory (what the library's
    p2p transport moves per call), alone; None where peer memory is unavailable."""
    if not env.on_gpu or env.world < 2:
        return None
    from overlap._p2p import memcpy_async
    from overlap.ops._runtime import get_runtime

    rt = get_runtime(env.group, env.device)
    heap = rt.p2p()
    if heap is None:
        return None
    nbytes = src.numel() * src.element_size()
    blk = heap.block("bench_push", nbytes * (env.world - 1))

    def fn() -> None:
        cur = torch.cuda.current_stream(env.device)
        for step in range(1, env.world):
            peer = (rt.rank + step) % env.world
            memcpy_async(blk.ptrs[peer] + (step - 1) * nbytes, src.data_ptr(), nbytes, cur)

    return fn
