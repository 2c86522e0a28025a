"""The fault rule: a device fault reaches every wait and every read that covers the faulted
work, whichever thread's wait CANN reported it to (README, "Threads and lifetimes")."""

from __future__ import annotations

import os
import random
import threading
from contextlib import closing

import numpy as np
import pytest

import pyacl_moe as pm

ITERATIONS = int(os.environ.get("PYACL_MOE_FAULT_ITERATIONS", "400"))
THREADS = 8
N, K, H = 8, 2, 4
X = np.arange(N * K * H, dtype=np.float32).reshape(N * K, H)
GOOD = np.arange(N * K, dtype=np.int32)
BAD = np.full(N * K, 99, np.int32)  # past the rows: the kernel faults (validate=False lets it through)
WANT = pm.reference.moe_init_routing_v2_grad(X, GOOD, K)


_last_how = threading.local()  # the way the calling thread read last, for the messages


def _read(rng: random.Random, out: pm.DeviceArray, streams: list[pm.Stream], device: pm.Device) -> np.ndarray:
    """``out`` read back one of the ways a user can: without a stream, on its writer's
    stream or another one, through another wrapper of its memory, or through a copy."""
    how = rng.randrange(5)
    _last_how.value = how
    if how == 0:
        return out.to_host()
    if how == 1:
        return out.to_host(rng.choice(streams))
    if how == 2:
        twin = pm.from_pointer(out.address, out.shape, out.dtype, owner=out, device=device)
        return twin.to_host(rng.choice(streams + [None]))
    if how == 3:
        return out.copy(rng.choice(streams + [None])).to_host()
    with closing(pm.Stream(device)) as own:
        own.wait_event(rng.choice(streams).record())
        return out.to_host(own)


def test_a_faulted_result_is_never_returned_without_an_error(device, no_leaks):
    """Eight threads launch kernels (some faulting) on shared streams, read the outputs back
    every way there is, and synchronize the streams and the device at random, so that CANN
    reports each fault to whichever wait comes first: a read of an output whose kernel
    faulted must raise, on any stream, through any wrapper; a read of a good output returns
    the right values (or raises a fault of work it was queued with: never wrong values)."""
    streams = [pm.Stream(device) for _ in range(3)]
    x = pm.to_device(X)
    good, bad = pm.to_device(GOOD), pm.to_device(BAD)
    silent: list[str] = []
    wrong: list[str] = []
    counts = {"faulted": 0, "raised": 0, "good": 0}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        rng = random.Random(i)
        try:
            for n in range(ITERATIONS):
                s = rng.choice(streams)
                what = rng.randrange(10)
                if what < 2:  # a wait some other thread's kernel may have faulted before
                    try:
                        rng.choice([*streams, device]).synchronize()
                    except pm.AclRuntimeError:
                        pass
                    continue
                faulting = what < 5
                out = pm.moe_init_routing_v2_grad(x, bad if faulting else good, K, stream=s, validate=False)
                try:
                    got = _read(rng, out, streams, device)
                except pm.AclRuntimeError as exc:
                    assert exc.status == 507015, exc
                    with lock:
                        counts["raised"] += 1
                    if faulting:
                        # Until it is written again, every read raises.
                        try:
                            _read(rng, out, streams, device)
                        except pm.AclRuntimeError:
                            pass
                        else:
                            with lock:
                                silent.append(f"thread {i} call {n}: a second read (read {_last_how.value})")
                    continue
                with lock:
                    counts["faulted" if faulting else "good"] += 1
                    if faulting:
                        silent.append(f"thread {i} call {n}: a faulted kernel's out read without an error "
                                      f"(read {_last_how.value})")
                    elif not np.array_equal(got, WANT):
                        wrong.append(f"thread {i} call {n}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors[0]
    assert not silent, silent[:5]
    assert not wrong, wrong[:5]
    assert counts["raised"] > 0 and counts["good"] > 0, counts
    for s in streams:
        try:
            s.close()
        except pm.AclRuntimeError:
            pass  # a fault the last waits recorded and no synchronize raised yet
    try:
        device.synchronize()
    except pm.AclRuntimeError:
        pass


def test_a_write_of_part_of_faulted_memory_leaves_the_rest_faulted(device, no_leaks):
    """A write through a view of part of the memory leaves the rest as it was: still faulted,
    however the view is written (from the host, a memset, on a stream or not); a write of all
    of it (or a launch that writes all of it) is the end of the fault."""
    x, bad, good = pm.to_device(X), pm.to_device(BAD), pm.to_device(GOOD)
    s = pm.Stream(device)
    for write_part in (lambda v: v.copy_from_host(np.zeros(v.shape, np.float32)),
                       lambda v: v.fill(0),
                       lambda v: v.copy_from_host(np.ones(v.shape, np.float32), stream=s)):
        out = pm.moe_init_routing_v2_grad(x, bad, K, validate=False)
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            out.to_host()
        write_part(out[:2])
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            out[2:].to_host()
        out.copy_from_host(WANT)
        np.testing.assert_array_equal(out.to_host(), WANT)
        # The same output rewritten by a launch that writes all of it.
        pm.moe_init_routing_v2_grad(x, bad, K, out=out, validate=False)
        with pytest.raises(pm.AclRuntimeError, match="507015"):
            out.to_host(s)
        pm.moe_init_routing_v2_grad(x, good, K, out=out)
        np.testing.assert_array_equal(out.to_host(), WANT)
    s.close()
