"""What a survivor on a shared GPU sees when its peer is SIGKILLed, by peer-memory kind.

Two processes on GPU 0, A and B. Each allocates a block, they exchange it (legacy CUDA
IPC: ``cudaIpcGetMemHandle`` bytes; ``vmm``: ``cuMemCreate`` exported as a file descriptor,
passed with ``SCM_RIGHTS``; ``none``: no exchange), and B checks a push into A's block.
A then queues its last work (``idle``: none; ``sleep``: a spin kernel of ~20 s; ``push``:
the spin, then a copy-engine push from A's block into B's, as a dying rank's late pushes)
and is SIGKILLed by this script. B then, step by step, each synchronized and its error
recorded: a local memset; a push into A's block; a read back from it; after 3 s a local
memset again; unmapping. Run with and without MPS (``--mps``: a daemon per variant, private
pipe and log folders, stopped after; no GPU setting is changed).

    python benchmarks/diag/mps_kill_diag.py [--mps] [--variants legacy:idle,vmm:push,...] [--out F.json]

Prints one line per variant and writes the JSON list of results.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NBYTES = 32 << 20
SPIN_CYCLES = 40_000_000_000  # ~20 s at 1.98 GHz

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


# ------------------------------------------------------------------ child side (A and B)


def _send(sock: socket.socket, payload: bytes, fds: list[int] | None = None) -> None:
    msg = len(payload).to_bytes(4, "little") + payload
    if fds:
        socket.send_fds(sock, [msg], fds)
    else:
        sock.sendall(msg)


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 4096, 4)
    n = int.from_bytes(data[:4], "little")
    while len(data) < 4 + n:
        data += sock.recv(4 + n - len(data))
    return data[4:4 + n], list(fds)


class Block:
    """This process's block and its peer's, by ``kind``."""

    def __init__(self, kind: str) -> None:
        import cupy
        from cupy.cuda import runtime

        self.kind, self.rt = kind, runtime
        cupy.cuda.Device(0).use()
        runtime.free(0)  # the primary context, current on this thread
        self.peer = None
        if kind == "vmm":
            sys.path.insert(0, str(REPO))
            from benchmarks.diag.vmm_driver import load_driver

            self.drv = load_driver()
            why = self.drv.supported(0)
            if why:
                raise RuntimeError(why)
            g = self.drv.granularity(0)
            self.size = -(-NBYTES // g) * g
            self.handle = self.drv.create(0, self.size)
            self.own = self.drv.map(0, self.handle, self.size, g)
            self.g = g
        else:
            self.size = NBYTES
            self.own = runtime.malloc(self.size)
        runtime.memset(self.own, 1, self.size)
        runtime.deviceSynchronize()

    def exchange(self, sock: socket.socket) -> None:
        if self.kind == "none":
            return
        if self.kind == "legacy":
            _send(sock, bytes(self.rt.ipcGetMemHandle(self.own)))
            h, _ = _recv(sock)
            self.peer = self.rt.ipcOpenMemHandle(h, 1)
        else:
            fd = self.drv.export_fd(self.handle)
            _send(sock, str(self.size).encode(), [fd])
            os.close(fd)
            size, fds = _recv(sock)
            self.peer_handle = self.drv.import_fd(fds[0])
            os.close(fds[0])
            self.peer = self.drv.map(0, self.peer_handle, int(size), self.g)

    def close_peer(self) -> None:
        if self.peer is None:
            return
        if self.kind == "legacy":
            self.rt.ipcCloseMemHandle(self.peer)
        else:
            self.drv.unmap(self.peer, self.size)
            self.drv.release(self.peer_handle)
        self.peer = None


def _step(results: dict, name: str, fn) -> None:
    t0 = time.time()
    try:
        detail = fn()
        results[name] = f"ok {time.time() - t0:.2f}s" + (f" {detail}" if detail else "")
    except Exception as e:  # noqa: BLE001 - the diagnosis is the error itself
        results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]} ({time.time() - t0:.2f}s)"


def child(role: str, kind: str, mode: str, fd: int) -> None:
    import cupy
    from cupy.cuda import runtime

    sock = socket.socket(fileno=fd)
    res: dict = {}
    blk = Block(kind)
    blk.exchange(sock)
    stream = cupy.cuda.Stream(non_blocking=True)
    if role == "A":
        spin = cupy.RawKernel(_SPIN, "spin")
        print("READY", flush=True)
        sys.stdin.readline()  # B checked its push
        with stream:
            if mode in ("sleep", "push"):
                spin((1,), (1,), (cupy.int64(SPIN_CYCLES),))
            if mode == "push" and blk.peer is not None:
                runtime.memcpyAsync(blk.peer, blk.own, blk.size, runtime.memcpyDefault, stream.ptr)
        print("QUEUED", flush=True)
        time.sleep(120)  # killed before this ends
        return
    # B
    host = bytearray(16)
    if blk.peer is not None:
        runtime.memset(blk.own, 7, blk.size)
        runtime.memcpy(blk.peer, blk.own, blk.size, runtime.memcpyDefault)
        runtime.memcpy(host_ptr := _host_ptr(host), blk.peer, 16, runtime.memcpyDefault)
        res["before_kill_push"] = "landed" if host == bytearray([7] * 16) else f"wrong bytes {bytes(host)!r}"
    print("READY " + json.dumps(res), flush=True)
    sys.stdin.readline()  # A was killed
    t_kill = time.time()
    time.sleep(0.5)

    def local() -> str:
        runtime.memsetAsync(blk.own, 3, blk.size, stream.ptr)
        stream.synchronize()
        return ""

    _step(res, "1_local_memset", local)
    if blk.peer is not None:
        def push() -> str:
            runtime.memcpyAsync(blk.peer, blk.own, blk.size, runtime.memcpyDefault, stream.ptr)
            stream.synchronize()
            return ""

        def read() -> str:
            runtime.memcpyAsync(host_ptr, blk.peer, 16, runtime.memcpyDefault, stream.ptr)
            stream.synchronize()
            return f"bytes {list(host[:4])}"

        _step(res, "2_push_into_dead", push)
        _step(res, "3_read_dead", read)
    time.sleep(max(0.0, 3.0 - (time.time() - t_kill)))
    _step(res, "4_local_after_3s", local)
    _step(res, "5_close_peer", blk.close_peer)
    print("RESULT " + json.dumps(res), flush=True)


def _host_ptr(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


# ------------------------------------------------------------------ driver side (no CUDA here)


def _readline(p: subprocess.Popen, want: str, limit: float) -> str:
    t0 = time.time()
    while time.time() - t0 < limit:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(want):
            return line.strip()
    raise TimeoutError(f"no {want!r} line within {limit:.0f} s (rc {p.poll()})")


def variant(kind: str, mode: str, env: dict) -> dict:
    import threading

    sa, sb = socket.socketpair()
    procs: dict = {}
    out: dict = {"kind": kind, "mode": mode}

    def _watchdog() -> None:  # a hung child ends the variant (its readline then sees EOF)
        out["watchdog"] = "killed after 30 s"
        for p in procs.values():
            if p.poll() is None:
                p.kill()

    dog = threading.Timer(30.0, _watchdog)
    dog.start()
    try:
        for role, s in (("A", sa), ("B", sb)):
            procs[role] = subprocess.Popen(
                [sys.executable, __file__, "--child", role, kind, mode, str(s.fileno())], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                pass_fds=(s.fileno(),))
        sa.close()
        sb.close()
        a, b = procs["A"], procs["B"]
        _readline(a, "READY", 40)
        out["b_ready"] = _readline(b, "READY", 40)[6:]
        a.stdin.write("go\n")
        a.stdin.flush()
        _readline(a, "QUEUED", 20)
        time.sleep(0.3)
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        b.stdin.write("go\n")
        b.stdin.flush()
        out["b"] = json.loads(_readline(b, "RESULT", 30)[7:])
        b.wait(20)
        out["b_rc"] = b.returncode
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        dog.cancel()
        for role, p in procs.items():
            if p.poll() is None:
                p.kill()
            try:
                _, err = p.communicate(timeout=10)
                if err.strip() and (role == "B" or "error" in out):
                    out[f"{role.lower()}_stderr_tail"] = err.strip()[-300:]
            except Exception:  # noqa: BLE001
                pass
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--mps", action="store_true")
    ap.add_argument("--variants", default="none:sleep,legacy:idle,legacy:push,vmm:idle,vmm:push")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from launch.shared_gpu import Mps

    results = []
    for v in args.variants.split(","):
        kind, mode = v.split(":")
        mps = Mps() if args.mps else None
        if mps is not None:
            mps.start()
            if not mps.info.get("running"):
                results.append({"kind": kind, "mode": mode, "mps": mps.info})
                continue
        env = dict(mps.env if mps is not None else os.environ)
        t0 = time.time()
        r = variant(kind, mode, env)
        r["mps"] = args.mps
        r["seconds"] = round(time.time() - t0, 1)
        if mps is not None:
            mps.stop()
            r["mps_stopped"] = mps.info.get("stopped")
        results.append(r)
        print(f"{'MPS' if args.mps else 'time-sliced'} {kind}:{mode}: {json.dumps(r.get('b', r.get('error')))}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
