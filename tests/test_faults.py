"""Sticky device faults: once any wait learns of a device fault, every launch, copy, wait and
read on the device raises it until Device.reset(), whichever thread's wait CANN told, on
every path (README, "Threads and lifetimes")."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm

ITERATIONS = int(os.environ.get("PYACL_MOE_FAULT_ITERATIONS", "40"))
THREADS = 6
N, K, H = 8, 2, 4
X = np.arange(N * K * H, dtype=np.float32).reshape(N * K, H)
GOOD = np.arange(N * K, dtype=np.int32)
BAD = np.full(N * K, 99, np.int32)  # past the rows: the kernel faults (validate=False lets it through)
WANT = pm.reference.moe_init_routing_v2_grad(X, GOOD, K)


def _faulted_output(device: pm.Device, s1: pm.Stream) -> pm.DeviceArray:
    """A backward whose kernel faults on s1 ([N, H]): what it leaves in its output is garbage."""
    x, bad = pm.to_device(X, stream=s1), pm.to_device(BAD, stream=s1)
    return pm.moe_init_routing_v2_grad(x, bad, K, stream=s1, validate=False)


@pytest.mark.parametrize("path", ["one call", "plan", "forward"])
def test_a_kernel_ordered_after_a_fault_by_an_event_raises_when_read(device, path):
    # s2 waits for s1 through an event, as the README says to, and runs a kernel that reads
    # s1's faulted output: reading s2's result waited for s2 only, which CANN reports no fault
    # to, and gave back garbage without an error.
    with closing(pm.Stream(device)) as s1, closing(pm.Stream(device)) as s2:
        garbage = _faulted_output(device, s1)
        s2.wait_event(s1.record())
        idx = pm.to_device(np.arange(N, dtype=np.int32), stream=s2)
        if path == "one call":
            out = pm.moe_init_routing_v2_grad(garbage, idx, 1, stream=s2)
        elif path == "plan":
            plan = pm.MoeInitRoutingV2Grad(garbage, idx, 1)
            out = plan(s2)
        else:
            ids = pm.to_device(pm.routing.random_top_k(N, 2, 4, seed=1), stream=s2)
            out = pm.moe_init_routing_v2(garbage, ids, expert_num=4, stream=s2).expanded_x
        with pytest.raises(pm.AclRuntimeError) as info:
            out.to_host()
        assert info.value.status == 507015 and "faulted" in info.value.message
        assert device.fault is not None


def test_a_fault_learned_in_another_thread_makes_every_path_raise_until_reset(device):
    s1, s2 = pm.Stream(device), pm.Stream(device)
    good = pm.to_device(WANT, stream=s2)
    s2.synchronize()
    x, idx = pm.to_device(X), pm.to_device(GOOD)
    plan = pm.MoeInitRoutingV2Grad(x, idx, K)
    plan(s2)
    _faulted_output(device, s1)
    learned: list[BaseException] = []
    t = threading.Thread(target=lambda: learned.append(pytest.raises(pm.AclRuntimeError, s1.synchronize).value))
    t.start()
    t.join()
    assert learned and learned[0].status == 507015
    # Every launch, copy, wait and read on the device raises that fault now, whatever memory
    # and stream it touches: the good array was written before the fault and is no exception.
    paths = {
        "read": lambda: good.to_host(), "read on a stream": lambda: good.to_host(s2),
        "read into": lambda: good.to_host(s2, out=np.empty_like(WANT)), "copy": lambda: good.copy(),
        "copy on a stream": lambda: good.copy(s2), "fill": lambda: good.fill(0, s2),
        "host write": lambda: good.copy_from_host(WANT), "to_device": lambda: pm.to_device(WANT),
        "NumPy call": lambda: pm.moe_init_routing_v2_grad(X, GOOD, K),
        "device call": lambda: pm.moe_init_routing_v2_grad(x, idx, K, stream=s2),
        "plan": lambda: plan(s2), "forward": lambda: pm.moe_init_routing_v2(WANT, np.zeros((N, 1), np.int32),
                                                                           expert_num=1),
        "stream synchronize": lambda: s2.synchronize(), "device synchronize": lambda: device.synchronize(),
        "event synchronize": lambda: s2.record().synchronize(),
    }
    for name, use in paths.items():
        with pytest.raises(pm.AclRuntimeError, match="507015") as info:
            use()
        assert "Device.reset()" in str(info.value), name
    s2.close()  # closing is no use of the device: it releases, and raises nothing learned before
    device.reset()
    assert device.fault is None and not device.closed
    for dead in (lambda: good.to_host(), lambda: plan(), lambda: s1.synchronize(), lambda: x.copy()):
        with pytest.raises(pm.ClosedError):
            dead()
    np.testing.assert_array_equal(pm.moe_init_routing_v2_grad(X, GOOD, K), WANT)
    dx, di = pm.to_device(X), pm.to_device(GOOD)
    np.testing.assert_array_equal(pm.moe_init_routing_v2_grad(dx, di, K).to_host(), WANT)


def _read(rng: random.Random, out: pm.DeviceArray, writer: pm.Stream, streams: list[pm.Stream],
          device: pm.Device) -> np.ndarray:
    """``out`` read back one of the ways a user can, each ordered after its writer: without a
    stream, on any stream, through another wrapper of its memory, through a copy, or on a
    stream of its own that waits for the writer's event."""
    how = rng.randrange(5)
    if how == 0:
        return out.to_host()
    if how == 1:
        return out.to_host(rng.choice(streams))
    if how == 2:
        twin = pm.from_pointer(out.address, out.shape, out.dtype, owner=out, device=device)
        return twin.to_host(rng.choice(streams + [None]))
    if how == 3:
        return out.copy().to_host()
    with closing(pm.Stream(device)) as own:
        own.wait_event(writer.record())
        return out.to_host(own)


def test_no_faulted_result_is_ever_returned_without_an_error(device):
    """Rounds of six threads launching kernels (some faulting) on shared streams and reading
    the outputs back every way there is, synchronizing streams and the device at random: a
    read returns the right values or raises the fault; once a wait learned of one, every read
    raises it; a reset ends the round."""
    silent, wrong, raised = [], [], [0]
    lock = threading.Lock()
    for round_ in range(4):
        streams = [pm.Stream(device) for _ in range(3)]
        x, good, bad = pm.to_device(X), pm.to_device(GOOD), pm.to_device(BAD)
        errors: list[BaseException] = []

        def worker(i: int, round_: int = round_, streams: list[pm.Stream] = streams, x: pm.DeviceArray = x,
                   good: pm.DeviceArray = good, bad: pm.DeviceArray = bad,
                   errors: list[BaseException] = errors) -> None:
            rng = random.Random(round_ * 100 + i)
            try:
                for n in range(ITERATIONS):
                    s = rng.choice(streams)
                    if rng.random() < 0.15:
                        try:
                            rng.choice([*streams, device]).synchronize()
                        except pm.AclRuntimeError:
                            pass
                        continue
                    faulting = rng.random() < 0.1
                    try:
                        out = pm.moe_init_routing_v2_grad(x, bad if faulting else good, K, stream=s, validate=False)
                        got = _read(rng, out, s, streams, device)
                    except pm.AclRuntimeError as exc:
                        assert exc.status == 507015, exc
                        with lock:
                            raised[0] += 1
                        continue
                    with lock:
                        if faulting:
                            silent.append(f"round {round_} thread {i} call {n}")
                        elif not np.array_equal(got, WANT):
                            wrong.append(f"round {round_} thread {i} call {n}")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        assert not errors, errors[0]
        if device.fault is not None:
            device.reset()
        else:
            for s in streams:
                s.close()
    assert not silent, silent[:5]
    assert not wrong, wrong[:5]
    assert raised[0] > 0


def test_a_synchronize_learns_the_fault_once_and_every_later_wait_raises_it(device, lazy_streams):
    with closing(pm.Stream(device)) as s:
        x, bad = pm.to_device(X, stream=s), pm.to_device(BAD, stream=s)
        pm.moe_init_routing_v2_grad(x, bad, K, stream=s, validate=False)  # faults when it runs
        faults = pm.emulator.stats()["device_faults"]
        with pytest.raises(pm.AclRuntimeError) as first:
            s.synchronize()
        assert first.value.status == 507015 and "a synchronize of stream" in first.value.message
        for _ in range(3):  # CANN reported it once and forgot it; the binding does not
            with pytest.raises(pm.AclRuntimeError, match="507015"):
                s.synchronize()
        assert pm.emulator.stats()["device_faults"] == faults + 1
    device.reset()


def test_a_stream_dropped_unclosed_after_a_fault_does_not_take_the_fault_with_it(device):
    # A dropped stream is destroyed at a safe point once idle; CANN's destroy drops the fault it
    # keeps for the stream, so the faulted output, and a kernel ordered after it by an event,
    # read back as garbage with no error.
    s1, s2 = pm.Stream(device), pm.Stream(device)
    garbage = _faulted_output(device, s1)
    s2.wait_event(s1.record())
    idx = pm.to_device(np.arange(N, dtype=np.int32), stream=s2)
    after = pm.moe_init_routing_v2_grad(garbage, idx, 1, stream=s2)
    while not s1.query():  # (idle: its release at the safe point does not wait for it)
        pass
    del s1
    gc.collect()
    pm.empty_cache()  # a safe point: the dropped stream is released
    assert device.fault is not None and device.fault[0] == 507015
    for read in (garbage.to_host, after.to_host, device.synchronize):
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            read()
    s2.close()


def test_a_device_wide_wait_waits_for_a_stream_wait_that_is_learning_a_fault(device, monkeypatch):
    # CANN reports a fault to one wait only. Thread A's synchronize of s1 has the report and has
    # not recorded it yet; thread B reads what s2 wrote after s1 through an event: its wait for
    # s2 and its device-wide wait come back clean, and it read garbage without an error.
    s1, s2 = pm.Stream(device), pm.Stream(device)
    garbage = _faulted_output(device, s1)
    s2.wait_event(s1.record())
    idx = pm.to_device(np.arange(N, dtype=np.int32), stream=s2)
    after = pm.moe_init_routing_v2_grad(garbage, idx, 1, stream=s2)
    s2.synchronize()  # (CANN tells s2 nothing)
    told = threading.Event()
    learn = pm.Device.learn

    def slow_learn(self, error, where):
        told.set()
        time.sleep(0.3)  # (the window between CANN's answer and its record, widened)
        return learn(self, error, where)

    monkeypatch.setattr(pm.Device, "learn", slow_learn)
    a = threading.Thread(target=lambda: pytest.raises(pm.AclRuntimeError, s1.synchronize))
    a.start()
    assert told.wait(30)
    with pytest.raises(pm.AclRuntimeError, match="507015"):
        after.to_host()
    a.join(30)
    monkeypatch.undo()
    device.reset()
