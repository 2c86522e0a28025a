"""Device: process set-up, contexts and threads, release order, interpreter exit."""

from __future__ import annotations

import atexit
import threading
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm

from . import children
from .emu_raw import Emu


def test_device_is_shared_per_id(device):
    assert pm.Device(0) is device
    assert device.device_id == 0 and int(device) == 0 and not device.closed
    assert device.context.device_id == 0 and device.context.alive
    free, total = device.mem_info()
    assert 0 < free <= total
    assert device.set_current() is device and pm.current_device() is device
    device.activate()
    assert pm.current_device() is device
    assert "Device 0" in repr(device)


def test_mem_info_follows_allocations(device):
    pm.empty_cache()  # what earlier tests left cached is not this test's
    free0, total = device.mem_info()
    a = pm.empty((64 << 20,), np.uint8)
    free1, total1 = device.mem_info()
    assert total1 == total and free0 - free1 >= 64 << 20
    del a
    pm.empty_cache()  # a dropped block waits in the array cache until then
    assert device.mem_info()[0] == free0


def test_invalid_device_id_is_refused():
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device(5)
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device("0")
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device(-1)
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device(True)
    with pytest.raises(pm.InvalidArgument, match="device"):
        pm.Stream("0")


def test_synchronize_waits_for_every_stream(device, lazy_streams):
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        x = pm.to_device(np.ones((64, 8), np.float32), stream=a)
        idx = pm.to_device(np.arange(64, dtype=np.int32), stream=b)
        assert pm.emulator.stats()["pending_tasks"] >= 2  # queued, not run
        device.synchronize()
        assert pm.emulator.stats()["pending_tasks"] == 0
        assert a.query() and b.query()
        del x, idx


def test_any_thread_may_use_any_object(device, no_leaks):
    results = {}
    set_before = pm.emulator.stats()["devices_set"]

    def worker(i: int) -> None:
        # This thread never touched CANN: the binding makes the device's context current on
        # first use (aclrtSetCurrentContext), without another aclrtSetDevice.
        with closing(pm.Stream(device)) as s:
            x = pm.to_device(np.full((8, 4), i, np.float32), stream=s)
            idx = pm.to_device(np.arange(8, dtype=np.int32), stream=s)
            results[i] = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s).to_host(s)
        results[i, "current"] = pm.current_device()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        np.testing.assert_array_equal(results[i], np.full((4, 4), 2.0 * i, np.float32))
        assert results[i, "current"] is device
    assert pm.emulator.stats()["devices_set"] == set_before


def child_close_releases_in_order() -> None:
    pm.use_emulator()
    pm.emulator.set_stream_mode("lazy")  # so that work is still queued when the device closes
    dev = pm.Device(0)
    s = pm.Stream(dev)
    ev = pm.Event(dev)
    arr = pm.to_device(np.ones(16, np.float32), stream=s)
    view = arr[2:6]
    x = pm.to_device(np.ones((8, 4), np.float32))
    idx = pm.to_device(np.arange(8, dtype=np.int32))
    _pending = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)  # queued, not run
    plan = pm.MoeInitRoutingV2Grad(x, idx, 2)
    tensor = pm.AclTensor(x)
    size, ex = pm.get_workspace_size(x, idx, 2, 0, 0, pm.empty((4, 4), np.float32))
    st = pm.emulator.stats()
    assert st["streams"] == 1 and st["events"] == 1 and st["device_allocations"] >= 4 and st["pending_tasks"] > 0, st
    ran = st["kernels_run"]
    dev.close()
    st = pm.emulator.stats()
    assert st["kernels_run"] == ran + 1 and st["device_faults"] == 0, st  # close waited for the queued kernel
    # CANN allows one aclInit per process: closing a device resets it, never finalizes.
    assert st["initialized"] == 1 and st["devices_set"] == 0, st
    assert st["device_allocations"] == 0 and st["streams"] == 0 and st["events"] == 0 and st["pending_tasks"] == 0, st
    assert dev.closed and not dev.context.alive
    # Everything is dead now: closing is a no-op, using raises ClosedError.
    for thing in (s, ev, arr, view, dev):
        assert thing.closed, thing
    for thing in (s, ev, arr, view, plan, tensor, ex, dev):
        thing.close()
    uses = (lambda: s.synchronize(), lambda: s.query(), lambda: view.to_host(), lambda: arr[0],
            lambda: ev.synchronize(), lambda: ev.record(s), lambda: plan(), lambda: pm.execute(None, 0, ex),
            lambda: dev.synchronize(), lambda: dev.activate(), lambda: dev.default_stream, lambda: pm.Stream(dev),
            lambda: pm.Event(dev), lambda: pm.empty((4,), np.float32, device=dev),
            lambda: pm.to_device(np.ones(2), device=dev))
    for i, use in enumerate(uses):
        try:
            use()
        except pm.ClosedError as e:
            assert isinstance(e, pm.PyaclMoeError) and isinstance(e, ValueError)
        else:
            raise SystemExit(f"use {i} after close did not raise ClosedError")
    # A new Device opens afresh, on the same aclInit.
    d2 = pm.Device(0)
    assert d2 is not dev and not d2.closed and pm.Device(0) is d2
    st = pm.emulator.stats()
    assert st["initialized"] == 1 and st["devices_set"] == 1, st
    np.testing.assert_array_equal(
        pm.moe_init_routing_v2_grad(np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32), 2),
        np.full((4, 4), 2.0, np.float32))
    print("ok")


def test_close_releases_in_order_and_objects_die(isolated):
    r = isolated(child_close_releases_in_order)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


def child_a_refused_release_is_tried_again() -> None:
    # CANN refuses one release of each kind once: the refusal is raised where a caller released
    # (AclTensor.close) or noted (empty_cache), and the device's close tries each again.
    pm.use_emulator()
    dev = pm.Device(0)
    x = pm.to_device(np.ones((8, 4), np.float32))
    tensors = [pm.AclTensor(x), pm.AclTensor(x)]
    pinned = pm.pinned_empty((1024,), np.float32)
    pinned.fill(1.0)
    st = pm.emulator.stats()
    assert st["tensors"] == 2 and st["host_allocations"] >= 1, st
    pm.emulator.inject_fault("aclDestroyTensor", 1)
    with pytest.raises(pm.AclError, match="aclDestroyTensor"):
        tensors[0].close()
    assert tensors[0].closed
    tensors[0].close()  # safe twice: the handle is the device's to try again now
    assert pm.emulator.stats()["tensors"] == 1  # (stats() is a safe point: it was tried again)
    tensors.append(pm.AclTensor(x))
    pm.emulator.inject_fault("aclDestroyTensor", 1)
    del tensors[1]  # dropped, not closed: the safe point's release is refused, and kept
    assert pm.emulator.stats()["tensors"] == 2
    del pinned
    pm.emulator.inject_fault("aclrtFreeHost", 1)
    with pytest.raises(pm.AclError, match="aclrtFreeHost"):
        pm.empty_cache()  # refused once: raised, and the block stays the device's
    assert pm.emulator.stats()["host_allocations"] >= 1
    dev.close()  # tries both refused releases again
    st = pm.emulator.stats()
    # The one AclTensor still referenced is a host object: it goes with its owner.
    assert st["tensors"] == 1 and st["host_allocations"] == 0 and st["device_allocations"] == 0, st
    assert tensors[1].closed
    tensors.clear()
    assert pm.emulator.stats()["tensors"] == 0
    print("ok")


def test_a_refused_release_is_tried_again(isolated):
    r = isolated(child_a_refused_release_is_tried_again)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


@pytest.fixture
def exit_probe() -> tuple[str, str]:
    """What tests/children.py's exit probe reads the emulator's counters at exit through:
    aclemu.h and the emulated libascendcl.so."""
    home = pm.emulator.build()
    return str(pm.emulator.SRC_DIR / "aclemu.h"), f"{home}/lib64/libascendcl.so"


def test_interpreter_exit_with_live_objects_is_clean(isolated, exit_probe):
    r = isolated(children.child_interpreter_exit_with_live_objects, *exit_probe)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr
    # Every device released, the queued kernel run first (no fault), and aclFinalize since this
    # process called aclInit. (aclTensors and executors are host objects: they go with theirs.)
    probe = r.stdout.split("at exit")[1].split()
    assert probe[:4] + probe[6:] == ["0"] * 6, r.stdout


def test_someone_else_initialized_acl(isolated, exit_probe):
    # A framework may have called aclInit already: the binding uses it and never finalizes it,
    # not even at exit.
    r = isolated(children.child_someone_else_initialized_acl, *exit_probe)
    assert r.returncode == 0, r.stderr
    assert "at exit 1 0 0 0 0 0 0 0" in r.stdout, r.stdout + r.stderr


def test_close_then_reopen_and_finalize_at_exit(isolated, exit_probe):
    r = isolated(children.child_close_then_reopen, *exit_probe)
    assert r.returncode == 0, r.stderr
    # aclFinalize at exit, since this process called aclInit.
    assert r.stdout.split("\n")[:2] == ["ok", "at exit 0 0 0 0 0 0 0 0"], r.stdout + r.stderr


def child_acltensor_of_a_closed_device() -> None:
    pm.use_emulator()
    dev = pm.Device(0)
    t = pm.AclTensor(pm.to_device(np.ones(4, np.float32)))
    dev.close()
    try:
        t.view_shape  # noqa: B018
    except pm.ClosedError:
        print("closed", t.closed)


def test_an_acltensor_of_a_closed_device_raises_closed_error(isolated):
    r = isolated(child_acltensor_of_a_closed_device)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["closed", "True"]


def child_multiple_devices() -> None:
    pm.use_emulator()
    assert pm.device_count() == 2
    d0, d1 = pm.Device(0), pm.Device(1)
    x1 = pm.to_device(np.ones((4, 2), np.float32), device=d1)
    i1 = pm.to_device(np.arange(4, dtype=np.int32), device=d1)
    out = pm.moe_init_routing_v2_grad(x1, i1, 2)
    assert out.device is d1
    # The thread's current device is now d1; d0 objects still work.
    assert pm.current_device() is d1
    x0 = pm.to_device(np.ones((4, 2), np.float32), device=d0)
    print(out.to_host().tolist(), x0.to_host().sum())
    try:
        pm.moe_init_routing_v2_grad(x0, i1, 2)
    except pm.InvalidArgument as e:
        print("refused:", e.parameter)
    try:
        pm.moe_init_routing_v2_grad(x1, i1, 2, stream=pm.Stream(d0))
    except pm.InvalidArgument as e:
        print("refused:", e.parameter)
    # Closing one device leaves the other working.
    d0.close()
    assert x0.closed and not x1.closed
    print(pm.moe_init_routing_v2_grad(x1, i1, 2).to_host().tolist())
    st = pm.emulator.stats()
    print(st["devices_set"])


def test_multiple_devices(isolated):
    r = isolated(child_multiple_devices, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[[2.0, 2.0], [2.0, 2.0]] 8.0"
    assert lines[1] == "refused: expanded_row_idx"
    assert lines[2] == "refused: stream"
    assert lines[3] == "[[2.0, 2.0], [2.0, 2.0]]"
    assert lines[4] == "1"


def child_device_fault_pending_at_exit():
    pm.use_emulator()
    x = pm.to_device(np.ones((4, 2), np.float32))
    idx = pm.to_device(np.array([0, 1, 2, 99], np.int32))  # 99 addresses no row: a device fault
    pm.moe_init_routing_v2_grad(x, idx, 1, validate=False)  # queued, never waited for
    print("queued")
    return [x, idx]  # (tests/child.py keeps them alive until exit)


def test_a_device_fault_pending_at_exit_is_reported_on_stderr(isolated):
    r = isolated(child_device_fault_pending_at_exit)
    assert r.returncode == 0, r.stderr
    assert "at exit, closing device 0 reported" in r.stderr and "507015" in r.stderr, r.stderr


def child_device_close_and_exit_wait_for_the_default_stream():
    emu = Emu()

    def check_at_exit():  # registered after pyacl_moe's exit hook (imported with tests/emu_raw.py)
        print("faults at exit", emu.stats()["device_faults"])

    atexit.register(check_at_exit)
    pm.use_emulator()
    if hasattr(pm.emulator, "set_stream_mode"):
        pm.emulator.set_stream_mode("lazy")
    dev = pm.Device(0)
    for _ in range(3):
        x = pm.to_device(np.ones((64, 8), np.float32), stream=dev.default_stream)
        idx = pm.to_device(np.arange(64, dtype=np.int32), stream=dev.default_stream)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=dev.default_stream)
        del x, idx
    dev.close()
    print("faults after close", pm.emulator.stats()["device_faults"])
    dev = pm.Device(0)
    x = pm.to_device(np.ones((64, 8), np.float32), stream=dev.default_stream)
    idx = pm.to_device(np.arange(64, dtype=np.int32), stream=dev.default_stream)
    out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=dev.default_stream)
    del x, idx  # exit with the work still queued
    return [dev, out]  # (tests/child.py keeps them alive until exit)


def test_device_close_and_exit_wait_for_the_default_stream(isolated):
    r = isolated(child_device_close_and_exit_wait_for_the_default_stream)
    assert r.returncode == 0, r.stderr
    assert "faults after close 0" in r.stdout, r.stdout + r.stderr
    assert "faults at exit 0" in r.stdout, r.stdout + r.stderr


def child_switch_devices() -> None:
    pm.use_emulator()
    d0, d1 = pm.Device(0), pm.Device(1)
    base = pm.emulator.stats()["devices_set"]
    for _ in range(2000):  # a reference per switch would show at once
        d0.set_current()
        d1.set_current()
    print(base, pm.emulator.stats()["devices_set"])


def test_switching_devices_does_not_grow_aclrtsetdevice_references(isolated):
    r = isolated(child_switch_devices, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    base, after = r.stdout.split()
    assert base == after == "2"


def test_daemon_threads_still_launching_at_exit_print_nothing(isolated):
    # The exit closes the devices under the daemon threads' feet: each one's next call raises
    # ClosedError, which ends it; the interpreter ends them a moment later anyway, so nothing
    # is printed for them (it printed one ClosedError traceback per thread).
    for _ in range(2):
        r = isolated(children.child_daemon_threads_launching_at_exit)
        assert r.returncode == 0, r.stderr
        assert "exiting with three daemon threads" in r.stdout
        assert r.stderr == "", r.stderr


def test_a_stream_dropped_while_its_device_closes_keeps_its_queued_work_memory(isolated):
    # A stream dropped with kernels queued, between the device's close starting and its wait:
    # its work has not run, so the memory that work writes must not be freed before the wait
    # (it was: the dropped stream counted as finished, 5 kernels wrote freed memory and the
    # close raised their fault). What the exit did to a daemon thread's stream.
    r = isolated(children.child_a_stream_dropped_while_its_device_closes)
    assert r.returncode == 0 and "closed cleanly" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("count", [24, pytest.param(200, marks=pytest.mark.slow)], ids=["short", "long"])
def test_emulator_children_never_die_at_exit(isolated, count):
    """Children that exit with work in flight, a daemon thread launching, or nobody to call
    aclFinalize (the emulator's engine thread then alive at exit), four at a time: none dies
    at exit (a thread of the emulator running in it while the interpreter finalized once
    crashed 4 of 92 such children)."""
    from concurrent.futures import ThreadPoolExecutor

    from .conftest import run_isolated

    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda k: run_isolated(children.child_exit_in_the_middle_of_work, k),
                             range(count)))
    died = [(k, r.returncode, r.stderr[-500:]) for k, r in enumerate(done)
            if r.returncode or "Traceback" in r.stderr]
    assert not died, died[:3]


def child_a_reset_inside_an_allocation() -> None:
    pm.use_emulator()
    from pyacl_moe import device as device_mod

    dev = pm.Device(0)
    real = device_mod.Device._malloc

    def reset_first(self, *args):  # another thread's reset, landing between _take and _malloc
        device_mod.Device._malloc = real
        self.reset()
        return real(self, *args)

    device_mod.Device._malloc = reset_first
    try:
        pm.empty((12345,), np.uint8)
    except pm.ClosedError as exc:
        print("ClosedError:", exc)
    a = pm.empty((12345,), np.uint8)  # the reset device allocates as ever
    a.copy_from_host(np.full(12345, 7, np.uint8))
    assert (a.to_host() == 7).all()
    print("ok")


def test_a_reset_inside_an_allocation_is_a_closed_error(isolated):
    """A reset between taking the cache's blocks and making a missing one raised KeyError (the
    new device's shelves had no shelf of that size): the allocation of the reset device's
    memory is a ClosedError, as every use of it is, and the device allocates again after."""
    r = isolated(child_a_reset_inside_an_allocation)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ClosedError: array is closed: its memory went with device 0" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("ok"), r.stdout


def test_a_reset_while_a_queued_copy_stages_never_writes_the_freed_staging_block(device, monkeypatch):
    """A copy queued from pageable memory snapshots it into a pinned block; a reset (or close)
    on another thread frees every pinned block. The snapshot was written after the teardown
    had freed the block (heap corruption, or a crash). It is now written under the stream's
    lock once the stream is known open, which the teardown shuts first: the copy is a
    ClosedError and the block is never written. The stand-in for the freed block here is
    NumPy memory, so that the test itself writes nothing it does not own."""
    from pyacl_moe import array as array_mod
    stream, arr = pm.Stream(device), pm.empty((4096,), np.uint8, device)
    freed = np.zeros(4096, np.uint8)

    def take_then_reset(dev, nbytes):
        array_mod.__dict__["_real_pinned_block"](dev, nbytes)
        dev.reset()  # what another thread may do right after the block is taken
        return freed

    monkeypatch.setitem(array_mod.__dict__, "_real_pinned_block", array_mod.pinned_block)
    monkeypatch.setattr(array_mod, "pinned_block", take_then_reset)
    with pytest.raises(pm.ClosedError):
        arr.copy_from_host(np.ones(4096, np.uint8), stream)
    assert not freed.any(), "the snapshot was written into the block the reset freed"
    monkeypatch.undo()
    b = pm.to_device(np.full(4096, 3, np.uint8), pm.Stream(device), device)  # the reset device works
    assert (b.to_host() == 3).all()
