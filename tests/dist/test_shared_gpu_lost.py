"""Shared-GPU mode, a lost CUDA context (``overlap.dist.shared``, ``overlap.flags``): under MPS a
process that exits with GPU work in flight faults every process on its GPU, so a survivor's
error checks raise ``GpuContextLostError`` naming the ranks on the GPU whose process is gone.
On the CPU: telling live processes from dead ones, the noting of peers when the group's peer
memory is opened, and the error words' translation, with the CUDA side stood in for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from overlap import flags
from overlap import protocol as P
from overlap.dist import context
from overlap.dist import shared as sh
from overlap.flags import ErrorWord, FlagTimeoutError, GpuContextLostError
from overlap.ops import _runtime as rtmod
from tests.dist.test_shared_gpu import _runtime

ILLEGAL = "CUDA error: an illegal memory access was encountered\nSearch for `cudaErrorIllegalAddress' ..."


@pytest.fixture(autouse=True)
def _no_peers():
    sh.forget_gpu_peers()
    yield
    sh.forget_gpu_peers()


@pytest.fixture()
def child():
    """A live child process; the test may kill it (it is reaped at the end either way)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def _peer(rank: int, pid: int) -> sh.GpuPeer:
    return sh.GpuPeer(rank, pid, sh.process_start(pid) or "")


def test_live_dead_zombie_and_reused_pids(child, tmp_path) -> None:
    me = sh.this_process(0)
    assert me.pid == os.getpid() and me.start
    sh.note_gpu_peers(0, [me, _peer(1, child.pid), sh.GpuPeer(2, os.getpid(), "0")])  # 2: a pid reused
    assert [p.rank for p in sh.gpu_peers()] == [1, 2]  # this rank is not its own peer
    assert [p.rank for p in sh.gone_gpu_peers()] == [2]
    child.kill()
    for _ in range(500):  # killed, not reaped: a zombie is gone too
        if sh.process_start(child.pid) is None:
            break
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{child.pid}")
    assert [p.rank for p in sh.gone_gpu_peers()] == [1, 2]
    child.wait()
    assert [p.rank for p in sh.gone_gpu_peers()] == [1, 2]
    # a command name with ") " in it does not shift the fields
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "stat").write_text("7 (a) S b) S 1 " + " ".join(str(i) for i in range(5, 30)) + "\n")
    assert sh.process_start(7, proc=str(tmp_path)) == "22"
    assert sh.process_start(8, proc=str(tmp_path)) is None


def test_peers_noted_when_peer_memory_opens(monkeypatch) -> None:
    """The ranks on this GPU (same host, same GPU id), none of another GPU or host."""
    ctx = SimpleNamespace(shared_gpu=True, gpu_share=2, device=torch.device("cpu"))
    rt = _runtime(monkeypatch, ctx)
    host = socket.gethostname()
    others = [(host, "", "gpu-a", sh.GpuPeer(1, 101, "5")), (host, "", "gpu-b", sh.GpuPeer(2, 102, "5")),
              ("elsewhere", "", "gpu-a", sh.GpuPeer(3, 103, "5"))]

    def gather(out, mine, group=None):
        out[:] = [mine, *others]

    monkeypatch.setattr(rtmod, "_gpu_id", lambda device: "gpu-a")
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    rt.world = 4
    rtmod._open_heap(rt)  # no cupy here: it returns why, after noting the peers
    assert sh.gpu_peers() == [sh.GpuPeer(1, 101, "5")]
    # one GPU per rank: nothing noted
    sh.forget_gpu_peers()
    rt = _runtime(monkeypatch, None)
    rt.world = 4
    others[0] = (host, "", "gpu-c", sh.GpuPeer(1, 101, "5"))
    rtmod._open_heap(rt)
    assert sh.gpu_peers() == []


def _word(monkeypatch, fail: BaseException | None = None, probe: BaseException | None = None) -> ErrorWord:
    w = ErrorWord("cpu", what="all_gather_matmul")
    w.probed = 0

    def probe_context() -> None:
        w.probed += 1
        if probe is not None:
            raise probe

    monkeypatch.setattr(w, "_probe_context", probe_context)
    if fail is not None:
        def check_word(block: bool) -> None:
            raise fail

        monkeypatch.setattr(w, "_check_word", check_word)
    return w


def test_lost_context_names_the_dead_peer(monkeypatch, child) -> None:
    sh.note_gpu_peers(0, [sh.this_process(0), _peer(1, child.pid)])
    child.kill()
    child.wait()
    for block in (True, False):
        with pytest.raises(GpuContextLostError) as ei:
            _word(monkeypatch, fail=RuntimeError(ILLEGAL)).check(block=block)
        msg = str(ei.value)
        assert msg.startswith("all_gather_matmul: rank 0: the CUDA context failed (CUDA error: an illegal memory")
        assert f"rank 1 (pid {child.pid}), which shared this GPU, has exited" in msg and "restart the job" in msg
        assert [p.rank for p in ei.value.gone] == [1]
        assert isinstance(ei.value.__cause__, RuntimeError)
    # no dead peer: still the lost context, saying none is seen
    sh.forget_gpu_peers()
    sh.note_gpu_peers(0, [sh.GpuPeer(1, os.getpid(), sh.this_process(0).start)])  # alive
    with pytest.raises(GpuContextLostError, match="no rank sharing this GPU has exited") as ei:
        _word(monkeypatch, fail=RuntimeError(ILLEGAL)).check()
    assert ei.value.gone == []


def test_other_errors_and_one_gpu_per_rank_unchanged(monkeypatch) -> None:
    # one GPU per rank (no peers noted): torch's own error, as before
    with pytest.raises(RuntimeError, match="illegal memory access") as ei:
        _word(monkeypatch, fail=RuntimeError(ILLEGAL)).check()
    assert not isinstance(ei.value, GpuContextLostError)
    sh.note_gpu_peers(0, [sh.GpuPeer(1, os.getpid(), sh.this_process(0).start)])
    for e in (ValueError("not CUDA"), TimeoutError("the op's work did not end"),
              FlagTimeoutError("op", 0, 1, 2, 1, 3)):
        with pytest.raises(type(e)) as ei:
            _word(monkeypatch, fail=e).check()
        assert ei.value is e


@pytest.mark.parametrize("how", ["check", "check_async"])
def test_async_check_asks_the_context_in_the_mode(monkeypatch, child, how) -> None:
    """``block=False`` with no record: in the mode it queries the stream (no wait), which
    raises a failed context's sticky error; one GPU per rank it touches nothing. An eager
    call's report (``check_async``, with its one-frame path) does the same."""
    def ask(w) -> None:  # noqa: ANN001
        w.check(block=False) if how == "check" else w.check_async()

    w = _word(monkeypatch, probe=RuntimeError(ILLEGAL))
    w._on_gpu, w._mirror = True, True  # the GPU path, with its pinned mirror
    ask(w)
    ask(w)  # (the second: the shared-GPU module known)
    assert w.probed == 0  # one GPU per rank: not asked
    sh.note_gpu_peers(0, [_peer(1, child.pid)])
    child.kill()
    child.wait()
    with pytest.raises(GpuContextLostError, match=f"rank 1 \\(pid {child.pid}\\)"):
        ask(w)
    assert w.probed == 1
    # a healthy context: nothing raised; a recorded timeout: raised without asking
    w2 = _word(monkeypatch)
    w2._on_gpu, w2._mirror = True, True
    ask(w2)
    assert w2.probed == 1
    w2._host_np[P.ERR_CODE], w2._host_np[P.ERR_RANK] = P.ERR_TIMEOUT, 0
    with pytest.raises(FlagTimeoutError) as ei:
        ask(w2)
    assert not isinstance(ei.value, GpuContextLostError) and w2.probed == 1
    sh.forget_gpu_peers()  # one GPU per rank again: a record is still raised, the context not asked
    w2._host_np[P.ERR_CODE], w2._host_np[P.ERR_RANK] = P.ERR_TIMEOUT, 0
    with pytest.raises(FlagTimeoutError):
        ask(w2)
    assert w2.probed == 1


def test_shutdown_forgets_the_peers(monkeypatch) -> None:
    sh.note_gpu_peers(0, [sh.GpuPeer(1, 1, "1")])
    monkeypatch.setattr(context, "_ctx", SimpleNamespace(_comms={}, _owns_pg=False))
    context.shutdown()
    assert sh.gpu_peers() == []


def test_the_error_is_exported() -> None:
    assert "GpuContextLostError" in flags.__all__ and issubclass(GpuContextLostError, RuntimeError)
    assert not issubclass(GpuContextLostError, FlagTimeoutError)  # reset() cannot help it
