"""Every error path: each CANN call the binding makes fails in turn.

For an operation, the nth counted call (n = 1, 2, ...) is made to fail by the emulator's fault
injection, until the operation completes with no fault hit. Each time: the right exception,
carrying the injected status, the failing API's name and the vendor's message; no object left
behind once the caches are emptied; and the same operation, without the fault, succeeds.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

LIVE = ("device_allocations", "device_bytes", "host_allocations", "streams", "events", "tensors",
        "scalars", "int_arrays", "executors")


def _settle() -> dict[str, int]:
    gc.collect()
    pm.Device(0).synchronize()
    pm.empty_cache()
    gc.collect()
    return pm.emulator.stats()


def sweep(op: Callable[[], object], check: Callable[[object], None], limit: int = 80) -> list[str]:
    """Fail each counted call of ``op`` in turn; returns the APIs that failed, in order."""
    op()  # warm: anything lazily loaded or built is not part of the sweep
    base = _settle()
    failed_apis = []
    for n in range(1, limit + 1):
        hits = pm.emulator.stats()["faults_hit"]
        pm.emulator.inject_fault("*", nth=n)
        try:
            result = op()
        except pm.AclError as exc:
            assert pm.emulator.stats()["faults_hit"] == hits + 1, f"call {n}: an error without the fault: {exc}"
            # The default injected status is the API's usual failure; the message is CANN's.
            assert exc.status != 0 and exc.name != "UNKNOWN_STATUS_%d" % exc.status
            assert exc.api.startswith("acl"), exc.api
            assert "fault injected" in exc.message, (n, exc.api, exc.message)
            op_api = exc.api.startswith(("aclnn", "aclCreate", "aclSet", "aclDestroy", "aclGet"))
            assert isinstance(exc, pm.AclnnError if op_api else pm.AclRuntimeError), (exc.api, type(exc))
            failed_apis.append(exc.api)
            del exc
        else:
            pm.emulator.clear_faults()
            assert pm.emulator.stats()["faults_hit"] == hits, "a fault fired but the operation did not report it"
            check(result)
            break
        finally:
            pm.emulator.clear_faults()
        after = _settle()
        leaked = {k: (base[k], after[k]) for k in LIVE if base[k] != after[k]}
        assert not leaked, f"failing call {n} ({failed_apis[-1]}) left objects behind: {leaked}"
        check(op())  # the next call, without the fault, succeeds
        _settle()
    else:
        pytest.fail(f"still failing after {limit} calls")
    assert failed_apis, "no call was counted"
    return failed_apis


@pytest.fixture
def clean():
    yield
    pm.emulator.clear_faults()
    pm.emulator.set_mutation(None)


CASE = make_case(8, 2, 16, "bfloat16", "drop-pad", seed=1)
WANT = pm.reference.moe_init_routing_v2_grad(*CASE.args())


def _right(result: object) -> None:
    got = result.to_host() if isinstance(result, pm.DeviceArray) else result
    assert compare(got, WANT).passed


def test_numpy_call(device, clean):
    apis = sweep(lambda: pm.moe_init_routing_v2_grad(*CASE.args()), _right)
    # Copies in, the cached executor's creation, the launch, the copy out, the wait.
    for api in ("aclrtMalloc", "aclrtMemcpyAsync", "aclCreateTensor", "aclnnMoeInitRoutingV2GradGetWorkspaceSize",
                "aclSetAclOpExecutorRepeatable", "aclnnMoeInitRoutingV2Grad", "aclrtSynchronizeStream"):
        assert api in apis, apis


def test_device_call_on_a_stream(device, clean):
    s = pm.Stream(device)
    x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

    def op():
        pm.empty_cache()  # every turn rebuilds the cached executor and refills the pool
        out = pm.moe_init_routing_v2_grad(x, idx, 2, 1, stream=s)
        return out.to_host(s)

    apis = sweep(op, _right)
    assert "aclrtMalloc" in apis and "aclnnMoeInitRoutingV2Grad" in apis
    s.close()


def test_uncached_call_with_validate_false(device, clean):
    x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)
    apis = sweep(lambda: pm.moe_init_routing_v2_grad(x, idx, 2, 1, validate=False).to_host(), _right)
    assert apis.count("aclCreateTensor") == 3


def test_plan(device, clean):
    x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

    def op():
        with pm.MoeInitRoutingV2Grad(x, idx, 2, 1) as plan:
            plan()
            plan()
            return plan.out.to_host()

    apis = sweep(op, _right)
    assert "aclSetAclOpExecutorRepeatable" in apis and apis.count("aclnnMoeInitRoutingV2Grad") == 2


def test_copies(device, clean):
    host = np.arange(64, dtype=np.float32).reshape(8, 8)
    s = pm.Stream(device)

    def op():
        a = pm.to_device(host)
        b = pm.to_device(host, stream=s)
        z = pm.zeros((8,), np.float32, stream=s)
        return a.to_host(), b[1:3, ::2].to_host(s), z.to_host(s)

    def check(r):
        np.testing.assert_array_equal(r[0], host)
        np.testing.assert_array_equal(r[1], host[1:3, ::2])
        np.testing.assert_array_equal(r[2], np.zeros(8, np.float32))

    apis = sweep(op, check)
    assert {"aclrtMalloc", "aclrtMemcpy", "aclrtMemcpyAsync", "aclrtMemsetAsync", "aclrtSynchronizeStream"} <= set(apis)
    s.close()


def test_stream_and_event_setup(device, clean):
    def op():
        with pm.Stream(device) as s:
            ev = s.record()
            ev.synchronize()
            ev.close()
            return True

    apis = sweep(op, lambda r: None)
    assert {"aclrtCreateStream", "aclrtCreateEvent", "aclrtRecordEvent", "aclrtSynchronizeEvent"} <= set(apis)


def test_device_setup(isolated):
    # A fresh process: aclInit, the device count and aclrtSetDevice fail in turn.
    r = isolated("""
import pyacl_moe as pm
pm.use_emulator()
pm.library_info()
seen = []
for n in range(1, 20):
    pm.emulator.inject_fault("*", nth=n)
    try:
        d = pm.Device(0)
    except pm.AclError as e:
        assert "fault injected" in e.message, e
        seen.append(e.api)
        st = pm.emulator.stats()
        assert st["initialized"] == 0 and st["devices_set"] == 0, (e.api, st)
        continue
    finally:
        pm.emulator.clear_faults()
    d.close()
    break
d = pm.Device(0)
assert not d.closed
print(" ".join(seen))
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["aclInit", "aclrtSetDevice"]


def test_a_failed_wait_keeps_what_queued_work_reads(device, clean):
    # If aclrtSynchronizeStream fails, the copy it should have waited for may still be queued:
    # its host buffer must stay alive until a later wait succeeds.
    s = pm.Stream(device)
    arr = pm.to_device(np.arange(1 << 16, dtype=np.float32))
    pm.emulator.inject_fault("aclrtSynchronizeStream", 1)
    with pytest.raises(pm.AclRuntimeError):
        arr.to_host(s)
    gc.collect()
    np.testing.assert_array_equal(arr.to_host(s), np.arange(1 << 16, dtype=np.float32))
    s.close()
