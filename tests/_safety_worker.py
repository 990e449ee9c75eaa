"""One rank of the gloo test of the ops' safety on their reference path (test_safety.py).

Ranks that disagree on shapes, dtypes or the norm get the same clear error on every
rank (never a gloo abort on one and a wrong result on another); the op stays usable
afterwards; a caller outside the group gets a clear error; inputs that require grad are
refused; no FutureWarning from the library on any call. Prints ``PASS safety rank=<r>``.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as tdist

from overlap import dist
from overlap.ops import Norm, all_gather_matmul, all_reduce_matmul


def expect_disagree(fn, what: str) -> str:  # noqa: ANN001
    try:
        fn()
    except ValueError as e:
        assert "disagree" in str(e), e
        return str(e)
    raise AssertionError(f"{what}: ranks that disagree were not refused")


def main() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init(timeout_s=30)
    warnings.simplefilter("error", FutureWarning)  # the library's calls stay quiet
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    k, n = 8, 6
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))

    def good_calls(tag: str) -> None:
        for call in range(2):
            full = torch.randn(ws * 4, k, generator=torch.Generator().manual_seed(call + 10))
            c = all_gather_matmul(full[rank * 4:(rank + 1) * 4], w.t())
            torch.testing.assert_close(c, full @ w.t(), msg=f"after {tag}")
            parts = [torch.randn(6, k, generator=torch.Generator().manual_seed(100 * r + call)) for r in range(ws)]
            c2, h = all_reduce_matmul(parts[rank], w.t())
            torch.testing.assert_close(h, sum(parts), msg=f"after {tag}")
            torch.testing.assert_close(c2, sum(parts) @ w.t(), msg=f"after {tag}")

    good_calls("start")
    # M/R differs on the last rank
    ms = 4 if rank < ws - 1 else 5
    msg = expect_disagree(lambda: all_gather_matmul(torch.randn(ms, k), w.t()), "agmm M/R")
    assert f"group ranks [{ws - 1}]" in msg and "5" in msg, msg
    good_calls("a disagreement on M/R")
    # the dtype differs on rank 0
    dt = torch.float64 if rank == 0 else torch.float32
    expect_disagree(lambda: all_gather_matmul(torch.randn(4, k, dtype=dt), w.t().to(dt)), "agmm dtype")
    expect_disagree(lambda: all_reduce_matmul(torch.randn(6, k, dtype=dt), w.t().to(dt)), "armm dtype")
    # K differs (then N differs as well, through b)
    kk = k if rank else k + 8
    expect_disagree(lambda: all_reduce_matmul(torch.randn(6, kk), torch.randn(kk, n)), "armm K")
    # a norm on some ranks only
    norm = Norm("layernorm", torch.ones(k), torch.zeros(k), 1e-5) if rank % 2 else None
    expect_disagree(lambda: all_reduce_matmul(torch.randn(6, k), w.t(), norm=norm), "armm norm")
    good_calls("the disagreements")
    # inputs that require grad: refused (no backward yet), not detached in silence
    for fn in (lambda a: all_gather_matmul(a, w.t()), lambda a: all_reduce_matmul(a, w.t())):
        try:
            fn(torch.randn(4, k, requires_grad=True))
        except RuntimeError as e:
            assert "no backward" in str(e), e
        else:
            raise AssertionError("an input that requires grad was accepted")
        with torch.no_grad():
            fn(torch.randn(4, k, requires_grad=True))  # fine without autograd
    # a caller outside the group
    if ws >= 3:
        sub = tdist.new_group([0, 1])
        if rank >= 2:
            try:
                all_gather_matmul(torch.randn(4, k), w.t(), group=sub)
            except ValueError as e:
                assert "not in the group" in str(e), e
            else:
                raise AssertionError("a caller outside the group was not refused")
        else:
            full = torch.randn(8, k, generator=torch.Generator().manual_seed(3))
            torch.testing.assert_close(all_gather_matmul(full[rank * 4:(rank + 1) * 4], w.t(), group=sub),
                                       full @ w.t())
    good_calls("the end")
    # what ran is in the report: the reference path, and why (no GPU), per op and shape
    from overlap import observe

    rows = {(r["op"], tuple(r["shape"])): r for r in observe.report().rows}
    row = rows[("all_gather_matmul", (ws * 4, n, k))]
    assert row["paths"][0]["path"] == "reference" and row["paths"][0]["why"] == "no GPU", row
    assert row["calls"] >= 8, row
    assert rows[("all_reduce_matmul", (6, n, k))]["calls"] >= 8, rows.keys()
    dist.shutdown()
    print(f"PASS safety rank={rank}", flush=True)


if __name__ == "__main__":
    main()
