"""Child functions that must decide what their fresh interpreter imports first (run by
conftest.run_isolated through tests/child.py): this module's top level imports the standard
library only, so nothing of pyacl_moe, NumPy or pytest is loaded before the function runs."""

from __future__ import annotations

import atexit
import ctypes
import json
import sys


def child_build() -> None:
    """Build (or find) the emulator, as a user's first import would, and print its home."""
    import pyacl_moe.emulator as e

    print(e.build())


# -------------------------------------------------------------------------------- test_bindings

def child_import_loads_nothing_then_one_load() -> None:
    """Import the package as a user would (nothing of the tests' imports first: tests/
    test_bindings.py imports the emulator), check that the import loaded, declared and imported
    nothing, then let 8 threads make the first use at once. Prints the number of loads, of
    infos, of distinct infos, whether no header text was declared twice, and the backend."""
    import threading

    import pyacl_moe as pm
    from pyacl_moe._cann import declare, loader

    assert pm.loaded_info() is None and loader._libs is None
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert "libascendcl" not in maps and "libopapi" not in maps, "a CANN library was mapped at import"
    assert not declare._texts, "the headers were given to cdef at import"
    assert "pyacl_moe.emulator" not in sys.modules, "the emulator was imported with the package"
    calls = []
    orig = loader._load_plan

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    loader._load_plan = counting
    infos = []
    barrier = threading.Barrier(8)

    def first_use():
        barrier.wait()
        infos.append(pm.library_info())

    ts = [threading.Thread(target=first_use) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(len(calls), len(infos), len({id(i) for i in infos}), len(declare._texts) == len(set(map(id, declare._texts))))
    print(infos[0].backend)  # PYACL_MOE_EMULATOR=1 chose the emulator


# ---------------------------------------------------------------------------------- test_device

def _register_exit_probe(aclemu_h: str, libascendcl: str):
    """Print the emulator's counters at exit, after pyacl_moe's exit hook: registered before
    pyacl_moe is imported (atexit runs hooks last-in, first-out), through cffi directly.
    Returns the probe's FFI and library."""
    import cffi

    ffi = cffi.FFI()
    with open(aclemu_h) as f:
        ffi.cdef(f.read() + "int aclInit(const char *configPath);")
    lib = ffi.dlopen(libascendcl)

    def at_exit():
        s = ffi.new("aclemuStats *")
        lib.aclemuGetStats(s)
        print("at exit", s.initialized, s.devices_set, s.device_allocations, s.streams, s.tensors, s.executors,
              s.pending_tasks, s.device_faults)

    atexit.register(at_exit)
    return ffi, lib


def child_interpreter_exit_with_live_objects(aclemu_h: str, libascendcl: str):
    _register_exit_probe(aclemu_h, libascendcl)
    import numpy as np

    import pyacl_moe as pm

    pm.use_emulator()
    pm.emulator.set_stream_mode("lazy")
    s = pm.Stream()
    a = pm.to_device(np.ones((64, 8), np.float32), stream=s)
    idx = pm.to_device(np.arange(64, dtype=np.int32), stream=s)
    out = pm.moe_init_routing_v2_grad(a, idx, 4, stream=s)  # still queued at exit
    plan = pm.MoeInitRoutingV2Grad(a, idx, 4)
    t = pm.AclTensor(a)
    print("exiting with everything alive")
    return [s, a, idx, out, plan, t]  # (tests/child.py keeps them alive until exit)


def child_someone_else_initialized_acl(aclemu_h: str, libascendcl: str):
    ffi, lib = _register_exit_probe(aclemu_h, libascendcl)
    import pyacl_moe as pm

    pm.use_emulator()
    pm.library_info()
    assert lib.aclInit(ffi.NULL) == 0  # "the framework"
    d = pm.Device(0)
    d.close()
    d = pm.Device(0)
    assert pm.emulator.stats()["initialized"] == 1
    return d  # open at exit


def child_close_then_reopen(aclemu_h: str, libascendcl: str):
    _register_exit_probe(aclemu_h, libascendcl)
    import pyacl_moe as pm

    pm.use_emulator()
    a = pm.Device(0)
    a.close()
    assert a.closed
    st = pm.emulator.stats()
    # Not finalized at close: CANN allows one aclInit per process.
    assert st["initialized"] == 1 and st["devices_set"] == 0, st
    c = pm.Device(0)  # the next one opens the device again
    assert c is not a and not c.closed
    c.close()
    print("ok")
    return [a, c]


# ---------------------------------------------------------------------- test_emulator_hardening

def child_c_config(home: str) -> None:
    """The C library alone, through ctypes: the Python check of the environment must not run
    first. Prints what aclInit and the calls that read the configuration return, as JSON."""
    acl = ctypes.CDLL(home + "/lib64/libascendcl.so")
    acl.aclGetRecentErrMsg.restype = ctypes.c_char_p
    count = ctypes.c_uint32()
    out = {"count": acl.aclrtGetDeviceCount(ctypes.byref(count))}
    out["init"] = acl.aclInit(None)
    out["msg"] = (acl.aclGetRecentErrMsg() or b"").decode()
    out["set"] = acl.aclrtSetDevice(0)
    out["set_msg"] = (acl.aclGetRecentErrMsg() or b"").decode()
    print(json.dumps(out))


# --------------------------------------------------------------------------- test_host_interop

def child_numpy_inputs_import_no_torch() -> None:
    import numpy as np

    import pyacl_moe as pm

    pm.use_emulator()
    x = np.ones((4, 2), np.float32)
    idx = np.arange(4, dtype=np.int32)
    pm.moe_init_routing_v2_grad(x, idx, 1)
    print("torch" in sys.modules)


def child_daemon_threads_launching_at_exit():
    import threading

    import numpy as np

    import pyacl_moe as pm

    pm.use_emulator()
    x = pm.to_device(np.ones((64, 256), np.float32))
    idx = pm.to_device(np.arange(64, dtype=np.int32))
    started = threading.Barrier(4)

    def launch_forever(sync: bool) -> None:
        s = pm.Stream()
        started.wait()
        while True:
            pm.moe_init_routing_v2_grad(x, idx, 1, stream=s)
            if sync:
                s.synchronize()

    for sync in (True, False, True):
        threading.Thread(target=launch_forever, args=(sync,), daemon=True).start()
    started.wait()
    print("exiting with three daemon threads launching")


def child_a_stream_dropped_while_its_device_closes():
    # The window the exit opened to daemon threads: a thread's stream, with kernels still
    # queued, dropped after its device began to close and before the close waited for it.
    import gc

    import numpy as np

    import pyacl_moe as pm
    from pyacl_moe import _lifetime
    from pyacl_moe.device import Device

    pm.use_emulator()
    pm.emulator.set_stream_mode("lazy")  # queued kernels run at the next wait
    dev = pm.Device(0)
    x = pm.to_device(np.ones((64, 256), np.float32))
    idx = pm.to_device(np.arange(64, dtype=np.int32))
    streams = [pm.Stream(dev)]
    for _ in range(5):  # each output dropped at once: an idle block that queued work still writes
        pm.moe_init_routing_v2_grad(x, idx, 1, stream=streams[0])

    real_wait = Device.wait_all

    def drop_the_stream_first(device, where):  # the close has refused new work, not yet waited
        streams.clear()
        gc.collect()
        _lifetime.collect()
        return real_wait(device, where)

    Device.wait_all = drop_the_stream_first
    dev.close()
    print("closed cleanly")


def child_exit_in_the_middle_of_work(kind: int) -> None:
    # Leaves the process with work of the binding's streams in flight, a daemon thread
    # launching, or the device opened on someone else's aclInit (so nobody finalizes and the
    # emulator's engine thread is still there at exit): the exit must be clean.
    import threading

    import cffi
    import numpy as np

    import pyacl_moe as pm

    pm.use_emulator()
    if kind % 4 == 3:
        ffi = cffi.FFI()
        ffi.cdef("int aclInit(const char *);")
        assert ffi.dlopen(pm.library_info().paths["ascendcl"]).aclInit(ffi.NULL) == 0  # "the framework"
    dev = pm.Device(0)
    x, idx = np.ones((256, 64), np.float32), np.arange(256, dtype=np.int32)
    s = pm.Stream(dev)
    dx, di = pm.to_device(x, stream=s), pm.to_device(idx, stream=s)
    if kind % 4 == 1:
        def launch() -> None:
            while True:
                pm.moe_init_routing_v2_grad(dx, di, 2, stream=s)

        threading.Thread(target=launch, daemon=True).start()
    for _ in range(64):
        pm.moe_init_routing_v2_grad(dx, di, 2, stream=s)  # queued, running as the process exits
    if kind % 4 == 2:
        pm.moe_init_routing_v2_grad(x, idx, 2)
    return [s, dx, di]  # type: ignore[return-value]  # (alive at exit)
