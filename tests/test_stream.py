"""Stream and Event: creation, ordering, waiting, timing, release."""

from __future__ import annotations

import gc
import time
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import make_case

from .conftest import settle


def test_stream_and_event_lifecycle(device, no_leaks):
    before = pm.emulator.stats()
    with closing(pm.Stream(device)) as s:
        assert s.handle != 0 and not s.closed and not s.is_default
        assert s.device is device and s.state.device is device
        assert pm.emulator.stats()["streams"] == before["streams"] + 1
        ev = s.record()
        assert isinstance(ev, pm.Event) and ev.device is device and ev.handle != 0
        ev.synchronize()
        assert ev.query()
        ev.close()
        ev.close()  # twice is fine
        assert ev.closed and ev.handle == 0
    assert s.closed
    with pytest.raises(pm.ClosedError, match="stream"):  # (CuPy's habit: it read 0, a handle no one has)
        _ = s.handle
    s.close()  # twice is fine
    with pytest.raises(pm.ClosedError, match="stream"):
        s.synchronize()
    with pytest.raises(pm.ClosedError, match="stream"):
        s.query()
    with pytest.raises(pm.ClosedError, match="event"):
        ev.synchronize()
    assert pm.emulator.stats()["streams"] == before["streams"]
    assert pm.emulator.stats()["events"] == before["events"]


def test_default_stream_wraps_null(device):
    s = device.default_stream
    assert s.is_default and s.handle == 0 and s is device.default_stream
    s.synchronize()
    assert s.query()
    with pytest.raises(pm.InvalidArgument, match="default stream, which lives as long as the device") as info:
        s.close()  # (it did nothing, silently: the default stream belongs to the device)
    assert info.value.parameter == "stream" and not s.closed
    s.synchronize()


def test_query_and_synchronize_follow_queued_work(device, lazy_streams, no_leaks):
    with closing(pm.Stream(device)) as s:
        assert s.query()  # nothing queued
        x = pm.to_device(np.ones((1024, 64), np.float32), stream=s)
        idx = pm.to_device(np.arange(1024, dtype=np.int32), stream=s)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
        assert not s.query()  # queued, not run (a query runs nothing)
        with pytest.raises(pm.AclRuntimeError) as info:
            s.synchronize(timeout_ms=0)  # CANN takes -1 or a positive timeout only
        assert info.value.status == 107000 and info.value.api == "aclrtSynchronizeStreamWithTimeout"
        assert not s.query()  # refused: nothing ran
        s.synchronize(timeout_ms=-1)  # -1: no limit
        assert s.query() and pm.emulator.stats()["pending_tasks"] == 0
        np.testing.assert_array_equal(out.to_host(s), np.full((256, 64), 4.0, np.float32))
        del x, idx, out


def test_a_synchronize_that_times_out_raises_507046(device, lazy_streams, no_leaks):
    # Lazy streams: the synchronize runs the first copy itself (tens of MiB: longer than 1 ms),
    # then finds its deadline passed with the second still queued.
    with closing(pm.Stream(device)) as s:
        host = np.ones(8 << 20, np.float32)
        a, b = pm.to_device(host, stream=s), pm.to_device(host, stream=s)
        with pytest.raises(pm.AclRuntimeError) as info:
            s.synchronize(timeout_ms=1)
        assert info.value.status == 507046 and info.value.api == "aclrtSynchronizeStreamWithTimeout"
        assert not s.query()
        s.synchronize()
        del a, b


@pytest.mark.parametrize("timeout", [-2, 2**31, 2**40, 1.5, "10", True])
def test_synchronize_refuses_a_bad_timeout(device, timeout):
    with pytest.raises(pm.InvalidArgument, match="timeout_ms"):
        device.default_stream.synchronize(timeout_ms=timeout)


def test_events_time_work_on_a_stream(device, lazy_streams, no_leaks):
    with closing(pm.Stream(device)) as s:
        x = pm.to_device(np.ones((4096, 256), np.float32), stream=s)
        idx = pm.to_device(np.arange(4096, dtype=np.int32), stream=s)
        start, end = pm.Event(device), pm.Event(device)
        assert not start.query()  # never recorded: not ready, as CANN reports it
        start.record(s)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
        assert s.record(end) is end
        assert not end.query()  # queued, not run
        with pytest.raises(pm.AclRuntimeError) as info:
            start.elapsed_ms(end)  # not yet run: no timestamp yet
        assert info.value.status == 107006
        end.synchronize()
        assert end.query() and start.query()
        assert start.elapsed_ms(end) >= 0.0
        assert (end - start) == start.elapsed_ms(end)
        np.testing.assert_array_equal(out.to_host(s), np.full((1024, 256), 4.0, np.float32))
        start.close(), end.close()
        del x, idx, out


def test_event_arguments_are_checked(device, no_leaks):
    ev = pm.Event(device)
    with pytest.raises(pm.InvalidArgument, match="end"):
        ev.elapsed_ms(None)
    with pytest.raises(pm.InvalidArgument, match="start"):
        ev - 1.0
    with pytest.raises(pm.InvalidArgument, match="stream"):
        ev.record("default")
    with pytest.raises(pm.InvalidArgument, match="event"):
        device.default_stream.wait_event(None)
    with pytest.raises(pm.InvalidArgument, match="event"):
        device.default_stream.wait_event(device.default_stream)
    ev.record()  # default: the device's default stream
    ev.synchronize()
    ev.close()
    with pytest.raises(pm.ClosedError, match="event"):
        device.default_stream.wait_event(ev)
    with pytest.raises(pm.ClosedError, match="end"):
        pm.Event(device).elapsed_ms(ev)


def test_stream_wait_event_orders_two_streams(device, no_leaks):
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        host = np.arange(64, dtype=np.float32)
        arr = pm.zeros((64,), np.float32, stream=a)
        arr.copy_from_host(host, stream=a)
        ev = a.record()
        b.wait_event(ev)
        # Reading on b waits (through the event) for a's copy.
        np.testing.assert_array_equal(arr.to_host(b), host)
        ev.close()
        del arr


def test_wait_event_holds_b_until_a_has_run(device, lazy_streams, no_leaks):
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        x = pm.to_device(np.ones((512, 32), np.float32), stream=a)
        idx = pm.to_device(np.arange(512, dtype=np.int32), stream=a)
        out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=a)
        ev = a.record()
        b.wait_event(ev)
        ran = pm.emulator.stats()["kernels_run"]
        assert not b.query()  # b waits for a's event, which has not run
        b.synchronize()  # running b runs a up to the event
        assert pm.emulator.stats()["kernels_run"] == ran + 1 and ev.query()
        ev.close()  # recorded and waited on: released at once, nothing queued uses it
        np.testing.assert_array_equal(out.to_host(b), np.full((128, 32), 4.0, np.float32))
        del x, idx, out


def test_an_event_closed_while_queued_work_uses_it_lives_until_that_work_ran(device, lazy_streams, no_leaks):
    with closing(pm.Stream(device)) as a, closing(pm.Stream(device)) as b:
        events = pm.emulator.stats()["events"]
        ev = a.record()
        b.wait_event(ev)
        ev.close()  # a record and a wait are queued on it
        assert ev.closed and pm.emulator.stats()["events"] == events + 1
        b.synchronize()
        a.synchronize()
        assert pm.emulator.stats()["events"] == events


def child_events_of_another_device_are_refused() -> None:
    pm.use_emulator()
    d0, d1 = pm.Device(0), pm.Device(1)
    ev = pm.Event(d1)
    for bad in (lambda: d0.default_stream.wait_event(ev), lambda: ev.record(pm.Stream(d0))):
        try:
            bad()
        except pm.InvalidArgument as e:
            print(e.parameter)


def test_events_of_another_device_are_refused(isolated):
    r = isolated(child_events_of_another_device_are_refused, env={"PYACL_MOE_EMU_DEVICES": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["event", "stream"]


def test_a_dropped_stream_and_event_are_released(device, no_leaks):
    streams, events = pm.emulator.stats()["streams"], pm.emulator.stats()["events"]
    s = pm.Stream(device)
    ev = s.record()
    assert pm.emulator.stats()["streams"] == streams + 1
    del s, ev
    gc.collect()
    st = pm.emulator.stats()  # waits for the releases pending
    assert st["streams"] == streams and st["events"] == events


def test_closing_a_stream_waits_for_it(device, lazy_streams, no_leaks):
    faults = pm.emulator.stats()["device_faults"]
    s = pm.Stream(device)
    x = pm.to_device(np.ones((64, 8), np.float32), stream=s)
    idx = pm.to_device(np.arange(64, dtype=np.int32), stream=s)
    out = pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
    assert pm.emulator.stats()["pending_tasks"] > 0
    s.close()
    st = pm.emulator.stats()
    assert st["pending_tasks"] == 0 and st["device_faults"] == faults
    np.testing.assert_array_equal(out.to_host(), np.full((16, 8), 4.0, np.float32))  # the array outlives it
    with pytest.raises(pm.ClosedError, match="stream"):
        pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
    with pytest.raises(pm.ClosedError, match="stream"):
        out.to_host(s)
    del x, idx, out


def test_a_read_waits_for_a_stream_another_thread_is_closing(device, lazy_streams, no_leaks):
    # A close refuses new work first, then waits for the stream. A read of memory the stream
    # writes, made in between on another thread, waited for nothing and read what was there
    # before the write (and under threads raised ClosedError once the close went on).
    data = np.arange(4096, dtype=np.float32)
    x = pm.zeros(data.shape, data.dtype, device)
    s = pm.Stream(device)
    x.copy_from_host(data, stream=s)  # queued; lazy: not run until something waits
    s.state.shut()  # where another thread's close() is before its wait
    assert np.array_equal(x.to_host(), data)
    s.close()
    s.close()  # and a second close once it is destroyed is still nothing


def test_an_asynchronous_call_never_blocks_and_a_fault_keeps_its_own_error(device, lazy_streams):
    case = make_case(8, 2, 16, "float32", "dropless", seed=7)
    with closing(pm.Stream(device)) as s:
        x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
        bad = pm.to_device(np.full(16, 99, np.int32), stream=s)
        pm.moe_init_routing_v2_grad(x, bad, 2, stream=s, validate=False)  # faults when it runs
        ran = pm.emulator.stats()["kernels_run"]
        for _ in range(5000):  # past any keep-alive limit
            pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
        assert pm.emulator.stats()["kernels_run"] == ran, "an asynchronous call waited for the stream"
        with pytest.raises(pm.AclRuntimeError) as info:
            s.synchronize()
        assert info.value.status == 507015
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            s.synchronize()  # sticky: the device is faulted until it is reset
    device.reset()


def test_a_dropped_stream_is_released_without_any_synchronize(device):
    settle()
    streams = pm.emulator.stats()["streams"]
    case = make_case(64, 4, 64, "float32", "dropless", seed=10)
    s = pm.Stream(device)
    x, idx = pm.to_device(case.grad_expanded_x, stream=s), pm.to_device(case.expanded_row_idx, stream=s)
    pm.moe_init_routing_v2_grad(x, idx, 4, stream=s)
    del s, x, idx
    # No synchronize: the stream goes once its work has run, at a later call into pyacl_moe.
    deadline = time.time() + 5
    while pm.emulator.stats()["streams"] != streams and time.time() < deadline:
        time.sleep(0.01)
    assert pm.emulator.stats()["streams"] == streams


def test_elapsed_time_of_an_event_never_recorded_says_so(device):
    """It raised CANN's 507000 "runtime internal error" (issue: papercuts, 12)."""
    start, end = pm.Event(device), pm.Event(device)
    end.record()
    with pytest.raises(pm.InvalidArgument, match="never recorded") as info:
        start.elapsed_ms(end)
    assert info.value.parameter == "event"
    start.record()
    with pytest.raises(pm.InvalidArgument, match="never recorded") as info:
        start.elapsed_ms(pm.Event(device))
    assert info.value.parameter == "end"
    end.record()
    device.synchronize()
    assert start.elapsed_ms(end) >= 0
    start.close()
    end.close()


def test_zeros_and_empty_default_to_float32(device):
    z = pm.zeros((2, 3))
    assert z.dtype == np.float32 and pm.empty((4,)).dtype == np.float32
    np.testing.assert_array_equal(z.to_host(), np.zeros((2, 3), np.float32))


def test_empty_cache_frees_a_fence_event_an_interrupt_left_out_of_the_spares(device):
    """An interrupt between a completed fence's pop and its return to the spares (StreamState.poll)
    left its event in neither list: empty_cache kept it for the stream's life, so the forward's
    interrupt soak read one live event too many (CI, under ASan)."""
    from pyacl_moe.stream import StreamState

    case = make_case(4, 2, 8, "float32", "dropless", seed=0)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    default = StreamState.FENCE_EVERY
    StreamState.FENCE_EVERY = 2
    try:
        before = settle()
        with closing(pm.Stream(device)) as s:  # (made now: its fences come every 2 launches)
            for _ in range(6):
                pm.moe_init_routing_v2_grad(x, idx, 2, stream=s)
            s.synchronize()
            state = s.state
            with state.lock:
                state.poll()
                assert state.spare, "no fence completed: the test needs one"
                state.spare.pop()  # what the interrupt did: the event is in neither spares nor fences
            after = settle()  # the stream still open: only empty_cache could free it
            assert after["events"] == before["events"], (before["events"], after["events"])
    finally:
        StreamState.FENCE_EVERY = default
