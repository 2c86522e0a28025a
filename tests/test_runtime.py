"""Device, Stream, Event: set-up, release order, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyacl_moe as pm


def test_device_is_shared_per_id(device):
    assert pm.Device(0) is device
    assert device.device_id == 0 and not device.closed
    free, total = device.mem_info()
    assert 0 < free <= total


def test_invalid_device_id_is_refused():
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device(5)
    with pytest.raises(pm.InvalidArgument, match="device_id"):
        pm.Device("0")


def test_stream_and_event_lifecycle(device, no_leaks):
    before = pm.emulator.stats()
    with pm.Stream(device) as s:
        assert s.handle != 0 and not s.closed
        assert pm.emulator.stats()["streams"] == before["streams"] + 1
        ev = s.record()
        ev.synchronize()
        ev.close()
        ev.close()  # twice is fine
        assert ev.closed
    assert s.closed
    s.close()  # twice is fine
    with pytest.raises(pm.InvalidArgument, match="stream"):
        s.synchronize()
    assert pm.emulator.stats()["streams"] == before["streams"]


def test_default_stream_wraps_null(device):
    s = device.default_stream
    assert s.is_default and s.handle == 0
    s.synchronize()
    s.close()  # a no-op: the default stream belongs to the device
    assert not s.closed


def test_events_time_work_on_a_stream(device, no_leaks):
    with pm.Stream(device) as s:
        x = pm.to_device(np.ones((4096, 256), np.float32), stream=s)
        idx = pm.to_device(np.arange(4096, dtype=np.int32), stream=s)
        start, end = pm.Event(device), pm.Event(device)
        start.record(s)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
        end.record(s)
        with pytest.raises(pm.AclRuntimeError) as info:
            start.elapsed_ms(end)  # not yet run: streams run when waited on
        assert info.value.status == 507006
        end.synchronize()
        assert start.elapsed_ms(end) >= 0.0
        assert (end - start) == start.elapsed_ms(end)
        np.testing.assert_array_equal(out.to_host(s), np.full((1024, 256), 4.0, np.float32))
        start.close(), end.close()
        del x, idx, out


def test_stream_wait_event_orders_two_streams(device, no_leaks):
    with pm.Stream(device) as a, pm.Stream(device) as b:
        host = np.arange(64, dtype=np.float32)
        arr = pm.zeros((64,), np.float32, stream=a)
        arr.copy_from_host(host, stream=a)
        ev = a.record()
        b.wait_event(ev)
        # Reading on b waits (through the event) for a's copy.
        np.testing.assert_array_equal(arr.to_host(b), host)
        ev.close()
        del arr


def test_any_thread_may_use_any_object(device, no_leaks):
    results = {}

    def worker(i: int) -> None:
        # This thread never called aclrtSetDevice itself: the binding does it on first use.
        with pm.Stream(device) as s:
            x = pm.to_device(np.full((8, 4), i, np.float32), stream=s)
            idx = pm.to_device(np.arange(8, dtype=np.int32), stream=s)
            results[i] = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s).to_host(s)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        np.testing.assert_array_equal(results[i], np.full((4, 4), 2.0 * i, np.float32))


def test_close_releases_in_order_and_objects_die(isolated):
    r = isolated("""
import numpy as np, pyacl_moe as pm
pm.use_emulator()
dev = pm.Device(0)
s = pm.Stream(dev)
ev = pm.Event(dev)
arr = pm.to_device(np.ones(16, np.float32), stream=s)
view = arr[2:6]
x = pm.to_device(np.ones((8, 4), np.float32)); idx = pm.to_device(np.arange(8, dtype=np.int32))
pending = pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)   # queued, not run
st = pm.emulator.stats()
assert st['streams'] == 1 and st['events'] == 1 and st['device_allocations'] >= 4, st
dev.close()
st = pm.emulator.stats()
assert st['initialized'] == 0 and st['devices_set'] == 0, st
assert st['device_allocations'] == 0 and st['streams'] == 0 and st['events'] == 0 and st['pending_tasks'] == 0, st
# Everything is dead now: closing is a no-op, using raises a clear error.
s.close(); ev.close(); arr.close(); dev.close()
for use in (lambda: s.synchronize(), lambda: view.to_host(), lambda: ev.synchronize()):
    try:
        use()
    except (pm.InvalidArgument, RuntimeError) as e:
        pass
    else:
        raise SystemExit('use after close did not raise')
# A new Device opens afresh.
d2 = pm.Device(0)
assert d2 is not dev and not d2.closed
print('ok')
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_reentrant_context_manager(isolated):
    r = isolated("""
import pyacl_moe as pm
pm.use_emulator()
with pm.Device(0) as a:
    with pm.Device(0) as b:
        assert a is b
    assert not a.closed          # inner exit does not close
assert a.closed                  # outermost does
assert pm.emulator.stats()['initialized'] == 0
print('ok')
""")
    assert r.returncode == 0, r.stderr


def test_interpreter_exit_with_live_objects_is_clean(isolated):
    r = isolated("""
import numpy as np, pyacl_moe as pm
pm.use_emulator()
s = pm.Stream()
a = pm.to_device(np.ones((64, 8), np.float32), stream=s)
idx = pm.to_device(np.arange(64, dtype=np.int32), stream=s)
out = pm.moe_init_routing_v2_grad(a, idx, 4, stream=s)
t = pm.AclTensor(a)
print('exiting with everything alive')
""")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


def test_someone_else_initialized_acl(isolated):
    # A framework may have called aclInit already: the binding uses it and never finalizes it.
    r = isolated("""
import pyacl_moe as pm
from pyacl_moe import _ffi
pm.use_emulator()
assert _ffi.init() is True      # "the framework"
d = pm.Device(0)
d.close()
assert pm.emulator.stats()['initialized'] == 1, 'finalized a CANN it did not initialize'
print('ok')
""")
    assert r.returncode == 0, r.stderr


def test_multiple_devices(isolated):
    r = isolated("""
import numpy as np, pyacl_moe as pm
pm.use_emulator()
assert pm.device_count() == 2
d0, d1 = pm.Device(0), pm.Device(1)
x1 = pm.to_device(np.ones((4, 2), np.float32), device=d1)
i1 = pm.to_device(np.arange(4, dtype=np.int32), device=d1)
out = pm.moe_init_routing_v2_grad(x1, i1, 2)
assert out.device is d1
# The thread's current device is now d1; d0 objects still work.
x0 = pm.to_device(np.ones((4, 2), np.float32), device=d0)
print(out.to_host().tolist(), x0.to_host().sum())
try:
    pm.moe_init_routing_v2_grad(x0, i1, 2)
except pm.InvalidArgument as e:
    print('refused:', e.parameter)
""", env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[[2.0, 2.0], [2.0, 2.0]] 8.0"
    assert lines[1] == "refused: expanded_row_idx"
