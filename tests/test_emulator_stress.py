"""A multi-threaded stress of the emulated runtime, through raw cffi.

``stress()`` is used twice: in-process under the default build (the ``emu`` fixture), and by
the slow tests at the bottom in a fresh interpreter against the sanitized builds
(PYACL_MOE_EMU_SANITIZE=address,undefined, and thread), which fail on any sanitizer report.
Several threads create and destroy streams and events, copy asynchronously, launch the kernel,
record, query and wait for events across threads, synchronize and switch contexts, in both
stream modes and while a thread toggles between them. Each worker does a number of operations,
not seconds' worth: STRESS_OPS in-process, SANITIZED_OPS (per phase) sanitized.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time

import numpy as np
import pytest

from . import children
from .conftest import run_isolated
from .emu_raw import Emu
from .stress import ITERATIONS, LONG_ITERATIONS, Progress, hammer

N, K, H = 4, 2, 8  # a tiny dropless case: x has N*K rows of H float32
STRESS_OPS = 160 * ITERATIONS  # operations per worker, in-process (PYACL_MOE_STRESS_ITERATIONS scales it)
SANITIZED_OPS = LONG_ITERATIONS  # operations per worker and phase, sanitized (the slow step)


class StressFailure(AssertionError):
    pass


def _tensor(emu, shape, dtype, p):
    s = emu.ffi.new("int64_t[]", list(shape))
    t = emu.nn.aclCreateTensor(s, len(shape), dtype, emu.NULL, 0, 2, s, len(shape), p)
    assert t != emu.NULL, emu.msg()
    return t


class _Kernel:
    """One repeatable executor over buffers of its own (so two launches never share an out)."""

    def __init__(self, emu, x, idx):
        self.emu = emu
        self.x_p, self.i_p = emu.malloc(x.nbytes), emu.malloc(idx.nbytes)
        self.o_p, self.w_p = emu.malloc(N * H * 4), emu.malloc(16 << 20)
        emu.h2d(self.x_p, x.tobytes())
        emu.h2d(self.i_p, idx.tobytes())
        self.tensors = [_tensor(emu, (N * K, H), 0, self.x_p), _tensor(emu, (N * K,), 3, self.i_p),
                        _tensor(emu, (N, H), 0, self.o_p)]
        ws, ex = emu.ffi.new("uint64_t *"), emu.ffi.new("aclOpExecutor **")
        st = emu.op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(*self.tensors[:2], K, 0, 0, self.tensors[2], ws, ex)
        assert st == 0, emu.msg()
        self.ws, self.ex = ws[0], ex[0]
        emu.ok(emu.nn.aclSetAclOpExecutorRepeatable(self.ex))

    def launch(self, stream):
        return self.emu.op.aclnnMoeInitRoutingV2Grad(self.w_p, self.ws, self.ex, stream)

    def close(self):
        emu = self.emu
        emu.ok(emu.nn.aclDestroyAclOpExecutor(self.ex))
        for t in self.tensors:
            emu.ok(emu.nn.aclDestroyTensor(t))
        for p in (self.x_p, self.i_p, self.o_p, self.w_p):
            emu.ok(emu.acl.aclrtFree(p))


def stress(emu, ops: int = STRESS_OPS, threads: int = 4, contexts=(), toggle_modes: bool = True,
           seed: int = 1) -> dict:
    """Run the stress on device 0 (current on the calling thread): ``threads`` workers do
    ``ops`` operations each, chosen at random, while (``toggle_modes``) a thread toggles the
    stream mode until they are done. ``contexts``: contexts of other devices to switch to and
    back. Returns counts of what ran; raises on any failure."""
    acl, ffi = emu.acl, emu.ffi
    rng0 = np.random.default_rng(seed)
    x = rng0.standard_normal((N * K, H)).astype(np.float32)
    idx = rng0.permutation(N * K).astype(np.int32)
    want = np.zeros((N, H), np.float32)
    for i in range(N):
        for t in range(K):
            want[i] += x[idx[i * K + t]]
    ctx = ffi.new("aclrtContext *")
    emu.ok(acl.aclrtGetCurrentContext(ctx))
    home_ctx = ctx[0]
    shared_streams, shared_events = [], []
    for _ in range(2):
        s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
        emu.ok(acl.aclrtCreateStream(s))
        emu.ok(acl.aclrtCreateEvent(e))
        # Recorded once up front: waiting on an event never recorded is 107000 (CANN's
        # Event::Wait), and the threads wait on these from the start.
        emu.ok(acl.aclrtRecordEvent(e[0], s[0]))
        shared_streams.append(s[0])
        shared_events.append(e[0])
    errors: list[str] = []
    counts: dict[str, int] = {}
    lock = threading.Lock()
    progress = Progress()

    def check(what, st):
        if st != 0:
            raise StressFailure(f"{what} returned {st}: {emu.msg()}")

    def worker(tid: int, steps: int) -> None:
        rng = random.Random(seed * 100 + tid)
        done: dict[str, int] = {}
        try:
            check("aclrtSetCurrentContext", acl.aclrtSetCurrentContext(home_ctx))
            # One kernel per stream it runs on: two streams run concurrently, so one out
            # buffer written from both would be a race of the test's own making.
            own, shared = _Kernel(emu, x, idx), [_Kernel(emu, x, idx) for _ in range(2)]
            host = bytearray(N * H * 4)
            hb = ffi.from_buffer(host)
            status = ffi.new("aclrtEventRecordedStatus *")
            sstatus = ffi.new("aclrtStreamStatus *")
            try:
                for _ in progress.steps(steps):
                    op = rng.choice(("stream", "stream", "shared", "event", "ctx", "sync", "query"))
                    done[op] = done.get(op, 0) + 1
                    if op == "stream":
                        s, e = ffi.new("aclrtStream *"), ffi.new("aclrtEvent *")
                        check("aclrtCreateStream", acl.aclrtCreateStream(s))
                        check("aclrtCreateEvent", acl.aclrtCreateEvent(e))
                        check("aclrtMemsetAsync", acl.aclrtMemsetAsync(own.o_p, N * H * 4, 0, N * H * 4, s[0]))
                        check("launch", own.launch(s[0]))
                        check("aclrtRecordEvent", acl.aclrtRecordEvent(e[0], s[0]))
                        check("aclrtMemcpyAsync", acl.aclrtMemcpyAsync(hb, len(host), own.o_p, len(host), 2, s[0]))
                        if rng.random() < 0.5:  # another stream waits for this one
                            j = rng.randrange(2)
                            check("aclrtStreamWaitEvent", acl.aclrtStreamWaitEvent(shared_streams[j], e[0]))
                        check("aclrtQueryEventStatus", acl.aclrtQueryEventStatus(e[0], status))
                        if rng.random() < 0.5:
                            check("aclrtSynchronizeEvent", acl.aclrtSynchronizeEvent(e[0]))
                            check("aclrtQueryEventStatus", acl.aclrtQueryEventStatus(e[0], status))
                            if status[0] != 1:
                                raise StressFailure("a synchronized event is not complete")
                        check("aclrtSynchronizeStream", acl.aclrtSynchronizeStream(s[0]))
                        got = np.frombuffer(bytes(host), np.float32).reshape(N, H)
                        if not np.allclose(got, want, rtol=1e-6, atol=1e-6):
                            raise StressFailure("wrong kernel result after synchronize")
                        check("aclrtDestroyEvent", acl.aclrtDestroyEvent(e[0]))
                        # Destroying waits for whatever is still queued (nothing, here).
                        check("aclrtDestroyStream", acl.aclrtDestroyStream(s[0]))
                        if acl.aclrtDestroyStream(s[0]) != 107017:
                            raise StressFailure("a destroyed stream is still accepted")
                    elif op == "shared":
                        j = rng.randrange(2)
                        check("launch shared", shared[j].launch(shared_streams[j]))
                        check("aclrtRecordEvent", acl.aclrtRecordEvent(shared_events[j], shared_streams[j]))
                        check("aclrtStreamWaitEvent", acl.aclrtStreamWaitEvent(emu.NULL, shared_events[1 - j]))
                        check("aclrtQueryEventStatus", acl.aclrtQueryEventStatus(shared_events[j], status))
                        if rng.random() < 0.3:
                            check("aclrtSynchronizeEvent", acl.aclrtSynchronizeEvent(shared_events[j]))
                    elif op == "event":
                        e = ffi.new("aclrtEvent *")
                        check("aclrtCreateEvent", acl.aclrtCreateEvent(e))
                        check("aclrtRecordEvent", acl.aclrtRecordEvent(e[0], emu.NULL))
                        check("aclrtQueryEventStatus", acl.aclrtQueryEventStatus(e[0], status))
                        check("aclrtSynchronizeEvent", acl.aclrtSynchronizeEvent(e[0]))
                        check("aclrtDestroyEvent", acl.aclrtDestroyEvent(e[0]))
                    elif op == "ctx" and contexts:
                        c = rng.choice(contexts)
                        check("aclrtSetCurrentContext", acl.aclrtSetCurrentContext(c))
                        s, p = ffi.new("aclrtStream *"), ffi.new("void **")
                        check("aclrtCreateStream", acl.aclrtCreateStream(s))
                        check("aclrtMalloc", acl.aclrtMalloc(p, 4096, 0))
                        check("aclrtMemsetAsync", acl.aclrtMemsetAsync(p[0], 4096, 1, 4096, s[0]))
                        check("aclrtDestroyStream", acl.aclrtDestroyStream(s[0]))
                        check("aclrtFree", acl.aclrtFree(p[0]))
                        check("aclrtSetCurrentContext", acl.aclrtSetCurrentContext(home_ctx))
                    elif op == "ctx":
                        cur = ffi.new("aclrtContext *")
                        check("aclrtGetCurrentContext", acl.aclrtGetCurrentContext(cur))
                        check("aclrtSetCurrentContext", acl.aclrtSetCurrentContext(cur[0]))
                    elif op == "sync":
                        j = rng.randrange(3)
                        if j == 2:
                            check("aclrtSynchronizeDevice", acl.aclrtSynchronizeDevice())
                        else:
                            check("aclrtSynchronizeStream", acl.aclrtSynchronizeStream(shared_streams[j]))
                    else:
                        j = rng.randrange(2)
                        check("aclrtStreamQuery", acl.aclrtStreamQuery(shared_streams[j], sstatus))
            finally:
                check("aclrtSynchronizeDevice", acl.aclrtSynchronizeDevice())
                for kern in (own, *shared):
                    kern.close()
        except BaseException as exc:  # reported by the main thread
            with lock:
                errors.append(f"thread {tid}: {exc!r}")
        with lock:
            for k, v in done.items():
                counts[k] = counts.get(k, 0) + v

    def toggler(i: int, steps: int) -> None:
        rng = random.Random(seed)
        mode = b"lazy"
        while progress.running:
            if acl.aclemuSetStreamMode(mode) != 0:
                errors.append("aclemuSetStreamMode failed")
            mode = b"async" if mode == b"lazy" else b"lazy"
            time.sleep(rng.uniform(0.001, 0.02))
        acl.aclemuSetStreamMode(b"async")

    pool = [progress.counted(worker) for _ in range(threads)] + ([toggler] if toggle_modes else [])
    try:
        raised = hammer(pool, ops, switch_interval=None, timeout=ops * 0.05 + 60)
    except AssertionError as exc:  # a thread still running: deadlock?
        raise StressFailure(f"threads did not finish (deadlock?): {exc}")
    errors.extend(repr(exc) for exc in raised)  # (the workers report their own failures)
    emu.ok(acl.aclrtSynchronizeDevice())
    for s in shared_streams:
        emu.ok(acl.aclrtDestroyStream(s))
    for e in shared_events:
        emu.ok(acl.aclrtDestroyEvent(e))
    if errors:
        raise StressFailure("; ".join(errors))
    return counts


def test_threaded_stress_of_shared_streams_and_events(emu):
    before = emu.stats()
    counts = stress(emu, threads=4, toggle_modes=True)
    assert counts.get("stream", 0) > 10 and counts.get("shared", 0) > 5, counts
    after = emu.stats()
    assert after["kernels_run"] - before["kernels_run"] > 20
    assert after["device_faults"] == before["device_faults"]
    assert emu.ffi.string(emu.acl.aclemuGetStreamMode()) == b"async"


# ---------------------------------------------------------------------------- sanitizers

def child_sanitized_stress(ops: int) -> None:
    """The stress in both stream modes, then toggling between them, switching to device 1's
    context too (run with a sanitizer's runtime preloaded); prints the counts as JSON."""
    emu = Emu()
    acl, ffi = emu.acl, emu.ffi
    assert acl.aclInit(ffi.NULL) == 0
    assert acl.aclrtSetDevice(1) == 0
    c1 = ffi.new("aclrtContext *")
    assert acl.aclrtGetCurrentContext(c1) == 0
    assert acl.aclrtSetDevice(0) == 0
    out = {}
    for mode in (b"async", b"lazy"):
        assert acl.aclemuSetStreamMode(mode) == 0
        out[mode.decode()] = stress(emu, ops, threads=4, contexts=(c1[0],), toggle_modes=False, seed=len(out) + 1)
    assert acl.aclemuSetStreamMode(b"async") == 0
    out["toggling"] = stress(emu, ops, threads=4, contexts=(c1[0],), toggle_modes=True, seed=7)
    assert acl.aclrtResetDevice(0) == 0 and acl.aclrtResetDevice(1) == 0
    assert acl.aclFinalize() == 0
    print(json.dumps(out))


SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
                     "WARNING: ThreadSanitizer", "SUMMARY: ")
# (PYACL_MOE_EMU_SANITIZE, runtime to preload, its options)
SANITIZER_RUNS = {
    "asan-ubsan": ("address,undefined", "libasan.so",
                   {"ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}),
    "tsan": ("thread", "libtsan.so", {"TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0"}),
}


def _sanitizer_runtime(cc: str, name: str) -> str | None:
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.parametrize("run", list(SANITIZER_RUNS))
def test_sanitized_emulator_under_threaded_stress(tmp_path, run):
    sanitize, runtime_name, options = SANITIZER_RUNS[run]
    cc = os.environ.get("CC", "cc")
    runtime = _sanitizer_runtime(cc, runtime_name)
    if runtime is None:
        pytest.skip(f"{cc} has no {runtime_name}")
    env = {"PYACL_MOE_EMU_SANITIZE": sanitize, "PYACL_MOE_CACHE": str(tmp_path / "cache"),
           "PYACL_MOE_EMU_DEVICES": "2", "LD_PRELOAD": None}
    # Build in a fresh interpreter of its own (the compiler must not run with the runtime preloaded).
    build = run_isolated(children.child_build, env=env, timeout=300)
    assert build.returncode == 0, build.stderr
    assert "emulator-san-" in build.stdout
    # CPython itself leaks at exit: leak detection off; any other report fails the run.
    proc = run_isolated(child_sanitized_stress, SANITIZED_OPS, env={**env, "LD_PRELOAD": runtime, **options},
                        timeout=900)
    reports = [m for m in SANITIZER_MARKERS if m in proc.stderr]
    assert not reports and proc.returncode == 0, proc.stderr[-20000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for phase in ("async", "lazy", "toggling"):
        assert out[phase].get("stream", 0) > 10, out
