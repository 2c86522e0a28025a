"""Every error path: each CANN call the binding makes fails in turn.

For an operation, the nth counted call (n = 1, 2, ...) is made to fail by the emulator's fault
injection, until the operation completes with no fault hit. ``"*"`` counts every call but
releases and queries; the queries (aclrtQueryEventStatus, aclrtStreamQuery,
aclrtGetCurrentContext, aclrtGetDeviceCount) are swept by name. Each time: the right exception,
carrying the injected status, the failing API's name and the vendor's message; no object left
behind once the caches are emptied; and the same operation, without the fault, succeeds. The
calls failed, in order, are exactly the counted calls a clean run of the operation makes: none
is skipped.

A few failures are the binding's to absorb, by design: a fence (an event recorded behind
queued work so that what it holds can go early) that cannot be created, recorded or polled
only means what it holds waits for the next synchronize; a dropped stream whose query fails is
asked again at the next safe point; an allocation that runs out of memory is retried once,
after the caches are emptied. Such a failure must not surface, and must leave the operation's
result right and nothing behind.

A wait that fails leaves the device faulted (sticky, as in CUDA: the binding cannot tell a
fault of the work from a failure of the wait): the sweep then resets the device and makes the
operation's arrays and streams again, as a user would.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import errors
from pyacl_moe._cann import loader
from pyacl_moe.stream import StreamState
from pyacl_moe.tools.cases import compare, make_case

from .conftest import LIVE, settle

LAUNCH = "aclnnMoeInitRoutingV2Grad"
OOM = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION, aclrtMalloc's usual failure
# Failures the binding absorbs (see the module docstring): never raised to the caller.
ABSORBED = {"aclrtCreateEvent", "aclrtRecordEvent", "aclrtQueryEventStatus", "aclrtStreamQuery", "aclrtMalloc",
            "aclrtMallocHost"}
# What the emulator's "*" does not count (docs/emulator.md): releases, queries, getters.
NOT_COUNTED = {
    "aclGetRecentErrMsg", "aclDestroyTensor", "aclDestroyScalar", "aclDestroyIntArray", "aclDestroyAclOpExecutor",
    "aclrtFree", "aclrtFreeHost", "aclrtDestroyStream", "aclrtDestroyEvent", "aclrtResetDevice", "aclFinalize",
    "aclrtGetDevice", "aclrtGetDeviceCount", "aclrtGetVersion", "aclrtGetSocName", "aclGetViewShape",
    "aclGetViewStrides", "aclGetViewOffset", "aclGetStorageShape", "aclGetDataType", "aclGetFormat",
    "aclGetRawTensorAddr", "aclrtQueryEventStatus", "aclrtStreamQuery", "aclrtGetCurrentContext",
}


class _Recording:
    """A loaded library whose functions note their name on each call (any thread)."""

    def __init__(self, lib: Any, calls: list[str]) -> None:
        self._lib = lib
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        calls = self._calls

        def call(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)

        return call


@contextlib.contextmanager
def _recorded() -> Iterator[tuple[list[str], list[pm.AclError]]]:
    """The CANN calls the binding makes meanwhile (through the loaded libraries) and every
    AclError it makes (all come from pyacl_moe.errors.error_for), raised or not."""
    calls: list[str] = []
    made: list[pm.AclError] = []
    libs = loader.libs()
    real_libs, real_error_for = (libs.acl, libs.nn, libs.op), errors.error_for

    def recording(status, api, message=""):
        exc = real_error_for(status, api, message)
        made.append(exc)
        return exc

    libs.acl, libs.nn, libs.op = (_Recording(lib, calls) for lib in real_libs)
    errors.error_for = recording
    try:
        yield calls, made
    finally:
        libs.acl, libs.nn, libs.op = real_libs
        errors.error_for = real_error_for


@contextlib.contextmanager
def _same_calls_every_time(fence_every: int | None) -> Iterator[None]:
    """Make an operation's calls the same in every iteration. Streams run lazily, so whether
    queued work is done never depends on timing (a completed fence leaves a spare event, a
    stream found idle needs no synchronize). Fences come every ``fence_every`` held enqueues
    (None: out of reach): elsewhere than in test_fences a fence would fall on a long-lived
    stream (the default stream's count keeps growing) at an iteration of its own choosing."""
    default = StreamState.FENCE_EVERY
    StreamState.FENCE_EVERY = fence_every or 2**62
    # A stream made before (the default stream) fixed its next fence then: push it out of
    # reach too, or the fence falls inside the sweep at a count set by the tests run before.
    states = [dev.default_stream.state for dev in pm.device.open_devices()] if fence_every is None else []
    for state in states:
        with state.lock:
            state.next_fence = state.point + 2**62
    mode = pm.emulator.stream_mode()
    pm.emulator.set_stream_mode("lazy")
    try:
        yield
    finally:
        pm.Device(0).synchronize()
        pm.emulator.set_stream_mode(mode)
        StreamState.FENCE_EVERY = default
        for state in states:
            with state.lock:
                state.next_fence = state.point + default


def _settle() -> dict[str, int]:
    """conftest.settle without the full collection (a full one costs tens of ms in a process
    holding the whole test session, and an iteration's garbage is young): the live counters."""
    gc.collect(1)
    for dev in pm.device.open_devices():
        dev.synchronize()
    pm.empty_cache()
    st = pm.emulator.stats()
    return {k: st[k] for k in LIVE}


def _leaks(base: dict[str, int]) -> dict[str, tuple[int, int]]:
    after = _settle()
    if after != base:
        after = settle()  # a full collection before calling it a leak
    return {k: (base[k], after[k]) for k in LIVE if base[k] != after[k]}


def sweep(make: Callable[[], Callable[[], object]], check: Callable[[object], None], api: str = "*",
          one_shot: bool = False, repeat: int = 1, fence_every: int | None = None) -> tuple[list[str], list[str]]:
    """Fail each counted call of the operation ``make()`` returns in turn; returns the APIs
    whose failure was raised and those whose failure was absorbed, in order. ``make`` is
    called again after a failure that left the device faulted (and reset).

    ``repeat``: fail that many calls in a row from the nth (an allocation that runs out of
    memory is retried once, after the caches are emptied: 2 makes the retry fail too).
    ``one_shot``: the operation launches one-shot executors. The emulator's injected failure
    comes before nnopbase's guard, which CANN's own failures past the argument checks (all made
    on the host) never do, so the executor the launch gave to CANN stays alive in the emulator:
    the one thing such a failure may leave behind."""
    with _same_calls_every_time(fence_every), _recorded() as (calls, made):
        op = make()
        check(op())  # warm: anything lazily loaded or built is not part of the sweep
        base = settle()
        calls.clear()
        check(op())
        expected = [c for c in calls if c not in NOT_COUNTED] if api == "*" else [c for c in calls if c == api]
        assert expected, f"{api}: no call was counted"
        assert not _leaks(base), "a clean run left objects behind"
        failed, absorbed, outcome = [], [], []
        for n in range(1, len(expected) + 2):
            hits = pm.emulator.stats()["faults_hit"]
            for _ in range(repeat):
                pm.emulator.inject_fault(api, nth=n)
            made.clear()
            calls.clear()
            try:
                result = op()
            except pm.AclError as exc:
                fired = pm.emulator.stats()["faults_hit"] - hits
                assert 1 <= fired <= repeat, f"call {n}: an error without the fault: {exc}"
                # The default injected status is the API's usual failure; the message is CANN's.
                assert exc.status != 0 and exc.name != "UNKNOWN_STATUS_%d" % exc.status
                assert exc.api.startswith("acl"), exc.api
                assert api in ("*", exc.api), (api, exc.api)
                assert "fault injected" in exc.message, (n, exc.api, exc.message)
                op_api = exc.api.startswith(("aclnn", "aclCreate", "aclSet", "aclDestroy", "aclGet"))
                assert isinstance(exc, pm.AclnnError if op_api else pm.AclRuntimeError), (exc.api, type(exc))
                failed.append(exc.api)
                outcome.append(exc.api)
                del exc
            else:
                fired = pm.emulator.stats()["faults_hit"] - hits
                pm.emulator.clear_faults()
                check(result)
                del result
                if not fired:
                    assert n == len(expected) + 1, f"call {n}: no fault fired, but a clean run makes {len(expected)}"
                    break
                injected = [e for e in made if "fault injected" in e.message]
                assert len(injected) == fired, f"call {n}: {fired} fault(s) fired, {len(injected)} reached the binding"
                what = injected[0].api
                assert what in ABSORBED, f"call {n}: a failure of {what} was not reported"
                # Only running out of memory is retried.
                assert what not in ("aclrtMalloc", "aclrtMallocHost") or injected[0].status == OOM
                absorbed.append(what)
                outcome.append(what)
                del injected
            finally:
                pm.emulator.clear_faults()
                made.clear()  # their tracebacks hold the frames of the calls that failed
            device = pm.Device(0)
            if device.fault is not None:  # a failed wait: the device is faulted until its reset
                device.reset()
                op = make()
            leaked = _leaks(base)
            if one_shot and outcome[-1] == LAUNCH and leaked == {"executors": (base["executors"],
                                                                             base["executors"] + 1)}:
                base = {**base, "executors": base["executors"] + 1}
                leaked = {}
            assert not leaked, f"failing call {n} ({outcome[-1]}) left objects behind: {leaked}"
            check(op())  # the next call, without the fault, succeeds
            _settle()  # and the next iteration starts where this one did (caches empty)
        else:
            counted = [c for c in calls if c not in NOT_COUNTED] if api == "*" else [c for c in calls if c == api]
            pytest.fail(f"still failing after {len(expected) + 1} calls: a clean run made {expected}, "
                        f"the last {counted}")
        _settle()  # nothing cached keeps a recording function once the sweep is over
    assert outcome == expected, "the calls failed are not the calls a clean run makes"
    return failed, absorbed


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
    def op():
        return pm.moe_init_routing_v2_grad(*CASE.args())

    failed, absorbed = sweep(lambda: op, _right)
    # The copies in, the cached executor's creation, the launch, the copy out, the wait: each
    # a failure raised. The NumPy call copies from the caller's arrays and waits before it
    # returns: no pinned staging.
    assert failed == ["aclrtMemcpyAsync"] * 2 + ["aclCreateTensor"] * 3 + [
        "aclnnMoeInitRoutingV2GradGetWorkspaceSize", "aclSetAclOpExecutorRepeatable", LAUNCH, "aclrtMemcpyAsync",
        "aclrtSynchronizeStream"], failed
    # The allocations (x, idx, out, the workspace): out of memory is retried once, after the
    # caches are emptied; failing the retry too is raised.
    assert absorbed == ["aclrtMalloc"] * 4, absorbed
    failed, absorbed = sweep(lambda: op, _right, api="aclrtMalloc", repeat=2)
    assert failed == ["aclrtMalloc"] * 4 and not absorbed


def test_device_call_on_a_stream(device, clean):
    def make():
        s = pm.Stream(device)
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

        def op():
            pm.empty_cache()  # every turn rebuilds the cached executor and takes a workspace
            out = pm.moe_init_routing_v2_grad(x, idx, 2, 1, stream=s)
            return out.to_host(s)
        return op

    failed, absorbed = sweep(make, _right)
    assert LAUNCH in failed and "aclrtMemcpyAsync" in failed and "aclrtMalloc" in absorbed
    failed, _ = sweep(make, _right, api="aclrtMalloc", repeat=2)
    assert failed == ["aclrtMalloc"] * 2  # out, the stream's workspace


def test_cached_call_rebinds(device, clean):
    # The cached executor relaunched on other arrays: the addresses are set, then the launch.
    def make():
        s = pm.Stream(device)
        pairs = [(pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)) for _ in range(2)]
        outs = [pm.empty(WANT.shape, WANT.dtype) for _ in range(2)]

        def op():
            for (x, idx), out in zip(pairs, outs):
                pm.moe_init_routing_v2_grad(x, idx, 2, 1, out=out, stream=s)
            return outs[0].to_host(s), outs[1].to_host(s)
        return op

    def check(r):
        _right(r[0])
        _right(r[1])

    failed, _ = sweep(make, check)
    assert {"aclSetInputTensorAddr", "aclSetOutputTensorAddr"} <= set(failed) and failed.count(LAUNCH) == 2, failed


def test_uncached_call_with_validate_false(device, clean):
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)
        return lambda: pm.moe_init_routing_v2_grad(x, idx, 2, 1, validate=False).to_host()

    failed, _ = sweep(make, _right, one_shot=True)
    assert failed.count("aclCreateTensor") == 3
    assert "aclnnMoeInitRoutingV2GradGetWorkspaceSize" in failed and LAUNCH in failed


def test_low_level_two_phases(device, clean):
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)
        other = pm.to_device(CASE.grad_expanded_x)
        outs = [pm.empty(WANT.shape, WANT.dtype) for _ in range(2)]

        def op():
            size, ex = pm.get_workspace_size(x, idx, 2, 1, 0, outs[0])
            ws = pm.empty((size,), np.uint8)
            pm.execute(ws, size, ex)  # one-shot
            with pm.get_workspace_size(x, idx, 2, 1, 0, outs[0])[1] as rep:
                rep.set_repeatable()
                pm.execute(ws, size, rep)
                tx, _, to = rep.tensors
                rep.set_input_addr(0, tx, other.data_ptr)
                rep.set_output_addr(0, to, outs[1].data_ptr)
                pm.execute(ws, size, rep)
            return outs[0].to_host(), outs[1].to_host()
        return op

    def check(r):
        _right(r[0])
        _right(r[1])

    failed, _ = sweep(make, check, one_shot=True)
    for api in ("aclCreateTensor", "aclnnMoeInitRoutingV2GradGetWorkspaceSize", "aclSetAclOpExecutorRepeatable",
                "aclSetInputTensorAddr", "aclSetOutputTensorAddr", "aclrtMemcpyAsync", "aclrtSynchronizeStream"):
        assert api in failed, (api, failed)
    assert failed.count(LAUNCH) == 3


def test_plan(device, clean):
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

        def op():
            with pm.MoeInitRoutingV2Grad(x, idx, 2, 1) as plan:
                plan()
                plan()
                return plan.out.to_host()
        return op

    failed, _ = sweep(make, _right)
    assert "aclSetAclOpExecutorRepeatable" in failed and failed.count(LAUNCH) == 2


def test_plan_rebind_and_one_shot(device, clean):
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)
        x2 = pm.to_device(CASE.grad_expanded_x)
        s = pm.Stream(device)

        def op():
            with pm.MoeInitRoutingV2Grad(x, idx, 2, 1) as plan:
                plan(s)
                plan.rebind(grad_expanded_x=x2, out=pm.empty(WANT.shape, WANT.dtype))
                out = plan(s)
            with pm.MoeInitRoutingV2Grad(x, idx, 2, 1, repeatable=False) as once:
                once(s)
                return out.to_host(s), once.out.to_host(s)
        return op

    def check(r):
        _right(r[0])
        _right(r[1])

    failed, _ = sweep(make, check, one_shot=True)
    assert {"aclSetInputTensorAddr", "aclSetOutputTensorAddr"} <= set(failed) and failed.count(LAUNCH) == 3


def test_copies(device, clean):
    host = np.arange(64, dtype=np.float32).reshape(8, 8)

    def make():
        s = pm.Stream(device)

        def op():
            a = pm.to_device(host)
            b = pm.to_device(host, stream=s)
            z = pm.zeros((8,), np.float32, stream=s)
            z0 = pm.zeros((8,), np.float32)
            return a.to_host(), b[1:3, ::2].to_host(s), z.to_host(s), z0.to_host()
        return op

    def check(r):
        np.testing.assert_array_equal(r[0], host)
        np.testing.assert_array_equal(r[1], host[1:3, ::2])
        np.testing.assert_array_equal(r[2], np.zeros(8, np.float32))
        np.testing.assert_array_equal(r[3], np.zeros(8, np.float32))

    failed, absorbed = sweep(make, check)
    assert {"aclrtMemcpyAsync", "aclrtMemsetAsync", "aclrtSynchronizeStream"} <= set(failed), failed
    assert sorted(absorbed) == ["aclrtMalloc"] * 4 + ["aclrtMallocHost"], absorbed  # staging of b
    failed, _ = sweep(make, check, api="aclrtMalloc", repeat=2)
    assert failed == ["aclrtMalloc"] * 4


def test_host_writes_and_reads_after_work_on_other_streams(device, clean):
    # A stream-less host write (or read) of memory another stream wrote last waits for that
    # stream (a synchronize: it learns of a fault of that work), then runs on the default
    # stream; on a stream it is that stream's (ordering it after other streams is the
    # caller's, through events).
    def make():
        s, t = pm.Stream(device), pm.Stream(device)
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

        def op():
            out = pm.moe_init_routing_v2_grad(x, idx, 2, 1, stream=s)
            x.copy_from_host(CASE.grad_expanded_x)
            pm.moe_init_routing_v2_grad(x, idx, 2, 1, out=out, stream=s)
            t.wait_event(s.record())
            x.copy_from_host(CASE.grad_expanded_x, stream=t)
            t.synchronize()
            return out.to_host()
        return op

    failed, _ = sweep(make, _right)
    assert {"aclrtSynchronizeStream", "aclrtCreateEvent", "aclrtRecordEvent", "aclrtStreamWaitEvent",
            "aclrtMemcpyAsync"} <= set(failed), failed
    # Waiting for the streams that wrote (s, then t after its event) is a synchronize of each,
    # never a query: a query does not report a device fault of their work.
    failed, absorbed = sweep(make, _right, api="aclrtSynchronizeStream")
    assert failed.count("aclrtSynchronizeStream") >= 3 and not absorbed, failed


def test_stream_and_event_setup(device, clean):
    def op():
        with closing(pm.Stream(device)) as s:
            ev = s.record()
            ev2 = pm.Event(device)
            s.wait_event(ev)
            ev2.record(s)
            ev2.synchronize()
            s.synchronize(timeout_ms=1000)
            ms = ev2 - ev
            done = s.query() and ev.query()
            ev.close()
            ev2.close()
            return ms >= 0 and done

    failed, _ = sweep(lambda: op, lambda r: r is True)
    assert {"aclrtCreateStream", "aclrtCreateEvent", "aclrtRecordEvent", "aclrtStreamWaitEvent",
            "aclrtSynchronizeEvent", "aclrtSynchronizeStreamWithTimeout", "aclrtEventElapsedTime",
            "aclrtSynchronizeStream"} <= set(failed), failed
    # The queries, by name: each raises, naming itself.
    for api in ("aclrtStreamQuery", "aclrtQueryEventStatus"):
        failed, absorbed = sweep(lambda: op, lambda r: r is True, api=api)
        assert failed == [api] and not absorbed


def test_fences(device, clean):
    # More held enqueues on a stream than a fence spaces: an event is recorded behind them and
    # polled, so what they hold goes without a synchronize. A fence that fails is absorbed.
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)
        out = pm.empty(WANT.shape, WANT.dtype)

        def op():
            with closing(pm.Stream(device)) as s:
                for _ in range(9):
                    pm.moe_init_routing_v2_grad(x, idx, 2, 1, out=out, stream=s)
                return out.to_host(s)
        return op

    failed, absorbed = sweep(make, _right, fence_every=4)
    # Two fences (the first is not complete when the second is recorded: two events).
    assert absorbed.count("aclrtCreateEvent") == 2 and absorbed.count("aclrtRecordEvent") == 2, absorbed
    assert failed.count(LAUNCH) == 9 and "aclrtSynchronizeStream" in failed
    failed, absorbed = sweep(make, _right, api="aclrtQueryEventStatus", fence_every=4)
    assert absorbed and not failed


def test_a_new_thread_switches_context(device, clean):
    # A thread that never used the device makes its context current (aclrtSetCurrentContext)
    # at its first call; that failing is raised like any other.
    def op():
        result = []

        def work():
            try:
                with closing(pm.Stream(device)) as s:
                    x = pm.to_device(CASE.grad_expanded_x, stream=s)
                    idx = pm.to_device(CASE.expanded_row_idx, stream=s)
                    result.append(pm.moe_init_routing_v2_grad(x, idx, 2, 1, stream=s).to_host(s))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result.append(exc)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        for r in result:
            if isinstance(r, BaseException):
                raise r
        return result[0]

    failed, _ = sweep(lambda: op, _right)
    assert failed[0] == "aclrtSetCurrentContext", failed
    assert {"aclrtCreateStream", "aclrtMemcpyAsync", LAUNCH} <= set(failed)


def test_a_dropped_stream(device, clean):
    # A stream dropped with work queued is released once aclrtStreamQuery says it is idle; a
    # query that fails is tried again later.
    def make():
        x, idx = pm.to_device(CASE.grad_expanded_x), pm.to_device(CASE.expanded_row_idx)

        def op():
            s = pm.Stream(device)
            out = pm.moe_init_routing_v2_grad(x, idx, 2, 1, stream=s)
            del s
            device.synchronize()
            return out.to_host()
        return op

    failed, absorbed = sweep(make, _right, api="aclrtStreamQuery")
    assert absorbed and set(absorbed) == {"aclrtStreamQuery"} and not failed  # each query asked again later


def child_device_setup_and_close() -> None:
    pm.use_emulator()
    pm.library_info()
    made = []
    real = errors.error_for

    def recording(*a):
        e = real(*a)
        made.append(e)
        return e

    errors.error_for = recording

    def op():
        d = pm.Device(0)
        s = pm.Stream(d)
        a = pm.to_device(np.ones((8, 4), np.float32), stream=s)
        pm.moe_init_routing_v2_grad(a, pm.to_device(np.arange(8, dtype=np.int32), stream=s), 2, stream=s)
        d.close()

    def sweep(api):
        seen = []
        for n in range(1, 80):
            hits = pm.emulator.stats()["faults_hit"] if pm.loaded_info() else 0
            pm.emulator.inject_fault(api, nth=n)
            try:
                op()
            except pm.AclError as e:
                assert "fault injected" in e.message, e
                seen.append(e.api)
            else:
                if pm.emulator.stats()["faults_hit"] == hits:
                    return seen
                # Only running out of memory is absorbed (the allocation is retried once).
                assert made[-1].api in ("aclrtMalloc", "aclrtMallocHost") and made[-1].status == 207001, made[-1]
                seen.append("absorbed:" + made[-1].api)
            finally:
                pm.emulator.clear_faults()
            for d in pm.device.open_devices():
                d.close()
            st = pm.emulator.stats()
            left = {k: st[k] for k in ("devices_set", "device_allocations", "streams", "events", "pending_tasks")
                    if st[k]}
            assert not left, (seen[-1], left)
        raise SystemExit("never succeeded")

    print(" ".join(sweep("*")))
    print(" ".join(sweep("*")))  # again: aclInit is done now, so no call is skipped by its absence
    for api in ("aclrtGetDeviceCount", "aclrtGetCurrentContext"):
        print(" ".join(sweep(api)))
    d = pm.Device(0)
    assert not d.closed
    print("initialized", pm.emulator.stats()["initialized"])


def test_device_setup_and_close(isolated):
    # A fresh process: aclInit, aclrtSetDevice, the context, then a device closed with work
    # queued; each call fails in turn, and nothing stays behind once the device is closed.
    r = isolated(child_device_setup_and_close)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    first, apis = lines[0].split(), lines[1].split()
    # aclInit once (a failed one leaves CANN uninitialized, a successful one stays for good).
    assert first[:2] == ["aclInit", "aclrtSetDevice"] and first.count("aclInit") == 1, first
    # Then every counted call of the device's life, its close included.
    assert apis[:2] == ["aclrtSetDevice", "aclrtCreateStream"] and "aclInit" not in apis, apis
    assert {"aclrtMemcpyAsync", "aclCreateTensor", LAUNCH, "aclrtSynchronizeDevice"} <= set(apis), apis
    assert apis.count("absorbed:aclrtMalloc") == 4 and apis.count("absorbed:aclrtMallocHost") == 2, apis
    assert lines[2:] == ["aclrtGetDeviceCount", "aclrtGetCurrentContext", "initialized 1"]


def test_a_failed_wait_keeps_what_queued_work_reads(device, clean, lazy_streams):
    # If aclrtSynchronizeStream fails, the copy it should have waited for may still be queued:
    # its host buffer must stay alive until a later wait has run it. The failure leaves the
    # device faulted; its reset waits for the device before it releases anything.
    s = pm.Stream(device)
    arr = pm.to_device(np.arange(1 << 16, dtype=np.float32), stream=s)
    s.synchronize()
    faults = pm.emulator.stats()["device_faults"]
    pm.emulator.inject_fault("aclrtSynchronizeStream", 1)
    with pytest.raises(pm.AclRuntimeError):
        arr.to_host(s)
    assert pm.emulator.stats()["pending_tasks"] > 0  # the copy is still queued, its buffer held
    assert device.fault is not None
    device.reset()
    assert pm.emulator.stats()["pending_tasks"] == 0 and pm.emulator.stats()["device_faults"] == faults
