"""The benchmarks behind ``pyacl-moe bench``.

Every figure is measured in this process, side by side with its baseline, as a median over
repeated batches. Host costs are compared with the cost of one bare foreign call through the
same FFI (aclrtGetDevice), so the ratios mean the same on any machine; absolute times on a
shared machine are noise. The floor under any launch path is ``raw_launch_ns``, one bare
foreign call of the second phase with the plan's own arguments; a plan's overhead is what it
costs above that floor.

On the emulator the host costs are measured with its streams in lazy mode, so that the
emulated kernels, which run on the same CPUs, do not compete with the launches being timed
(on an NPU the device does not use the host's cores). The lifetime tracking is the same in
both modes.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from contextlib import closing
from typing import Any

import numpy as np

from .. import emulator, reference
from .._cann import acl
from .._cann.loader import EMULATOR, library_info
from ..array import empty, to_device
from ..device import current_device
from ..op.moe_init_routing_v2_grad import MoeInitRoutingV2Grad, moe_init_routing_v2_grad
from ..pool import memory_stats
from ..stream import Event, Stream
from .cases import Case, make_case

KEYS = (
    "backend",
    "ffi_call_ns",
    "raw_launch_ns",
    "plan_launch_ns",
    "oneshot_launch_ns",
    "numpy_call_ns",
    "numpy_copy_ns",
    "numpy_kernel_ns",
    "numpy_call_mallocs",
    "reference_s",
    "reference_copy_s",
    "kernel_s",
    "kernel_copy_s",
)

# name: (numerator, subtracted, denominator, factor): numerator - subtracted <= factor * denominator.
TARGETS = {
    "plan overhead": ("plan_launch_ns", "raw_launch_ns", "ffi_call_ns", 1.0),
    "one-shot launch": ("oneshot_launch_ns", None, "ffi_call_ns", 20.0),
    # The call's cost above its kernel (which the emulator runs on the host's own cores).
    "NumPy call": ("numpy_call_ns", "numpy_kernel_ns", "numpy_copy_ns", 1.3),
    "reference": ("reference_s", None, "reference_copy_s", 2.0),
}


def _per_call_ns(fn: Callable[[], Any], calls: int, batches: int, between: Callable[[], Any] | None = None) -> float:
    """Median over batches of the time per call, in ns. ``between`` runs untimed after each
    batch (e.g. to let the queued kernels run)."""
    results = []
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside a batch is not the call's cost
    try:
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            results.append((time.perf_counter_ns() - t0) / calls)
            if between is not None:
                between()
    finally:
        if gc_was:
            gc.enable()
    return statistics.median(results)


def _seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_costs(calls: int, batches: int) -> dict[str, float]:
    """Bare call, raw launch, plan relaunch, one-shot call and one-shot without the executor
    cache, in ns. Their batches are interleaved, so the medians see the same machine: the
    ratios hold even when the machine is busy."""
    dev = current_device()
    fn, arg = acl.call_probe()
    case = make_case(1, 1, 1, "float32", "dropless", seed=0)  # the kernel is not what is timed
    times: dict[str, list[float]] = {k: [] for k in ("ffi", "raw", "overhead", "oneshot", "uncached")}
    lazy = library_info().backend == EMULATOR
    if lazy:
        emulator.set_stream_mode("lazy")
    try:
        with closing(Stream(dev)) as s:
            x, idx = to_device(case.grad_expanded_x, stream=s), to_device(case.expanded_row_idx, stream=s)
            out = empty((1, 1), np.float32, dev)
            with MoeInitRoutingV2Grad(x, idx, 1, out=out) as plan:
                plan(s)  # the first launch binds stream and workspace
                moe_init_routing_v2_grad(x, idx, 1, out=out, stream=s)
                raw_fn, raw_args = plan.launch_probe(s)
                # Every timed callable is a partial, so each pays the same call overhead.
                bare = functools.partial(fn, arg)
                raw = functools.partial(raw_fn, *raw_args)
                relaunch = functools.partial(plan, s)
                one = functools.partial(moe_init_routing_v2_grad, x, idx, 1, out=out, stream=s)
                # validate=False: three aclCreateTensor, the first phase, the launch, three
                # aclDestroyTensor on every call (no executor cache). A text-only figure.
                uncached = functools.partial(moe_init_routing_v2_grad, x, idx, 1, out=out, stream=s, validate=False)
                small = max(calls // 10, 20)
                for _ in range(batches):
                    # The unit is measured right before and right after the launches it is
                    # compared with, so a change of clock speed hits both sides alike. Raw and
                    # plan launches alternate in small batches: the plan's overhead is the
                    # median of their paired differences, taken on the same machine state.
                    before = _per_call_ns(bare, calls, 1)
                    for _ in range(10):
                        r = _per_call_ns(raw, small, 1, s.synchronize)
                        times["raw"].append(r)
                        times["overhead"].append(_per_call_ns(relaunch, small, 1, s.synchronize) - r)
                    times["ffi"].append((before + _per_call_ns(bare, calls, 1)) / 2)
                    times["oneshot"].append(_per_call_ns(one, max(calls // 5, 100), 1, s.synchronize))
                    times["uncached"].append(_per_call_ns(uncached, max(calls // 20, 50), 1, s.synchronize))
            s.synchronize()
    finally:
        if lazy:
            emulator.set_stream_mode("async")
    res = {k: statistics.median(v) for k, v in times.items()}
    res["plan"] = res["raw"] + res["overhead"]
    return res


def _numpy_path(batches: int) -> tuple[float, float, float, float]:
    dev = current_device()
    case = make_case(64, 8, 1024, "bfloat16", "dropless", seed=1)
    s = dev.default_stream
    def call() -> None:
        moe_init_routing_v2_grad(*case.args())

    def copies() -> None:
        dx = to_device(case.grad_expanded_x, stream=s)
        di = to_device(case.expanded_row_idx, stream=s)
        out = empty((case.tokens, case.grad_expanded_x.shape[-1]), case.grad_expanded_x.dtype, dev)
        out.to_host(s)
        del dx, di

    dx, di = to_device(case.grad_expanded_x), to_device(case.expanded_row_idx)
    dout = empty((case.tokens, case.grad_expanded_x.shape[-1]), case.grad_expanded_x.dtype, dev)

    def kernel() -> None:  # what the call runs on the device, launched and waited for
        moe_init_routing_v2_grad(dx, di, case.top_k, out=dout, stream=s)
        s.synchronize()

    call()
    copies()
    kernel()
    call_ns, copy_ns, kernel_ns = [], [], []
    for _ in range(batches):  # interleaved, so all three see the same machine
        call_ns.append(_per_call_ns(call, 20, 1))
        copy_ns.append(_per_call_ns(copies, 20, 1))
        kernel_ns.append(_per_call_ns(kernel, 20, 1))
    # Allocations through the binding (device and pinned blocks, workspaces), counted the same
    # way on any backend: a cache miss is one aclrtMalloc or aclrtMallocHost.
    before = _allocations(dev)
    for _ in range(20):
        call()
    mallocs = (_allocations(dev) - before) / 20
    return statistics.median(call_ns), statistics.median(copy_ns), statistics.median(kernel_ns), mallocs


def _allocations(dev: Any) -> int:
    st = memory_stats(dev)
    return int(st["misses"] + st["array_misses"] + st["pinned_misses"])


def _big_case(quick: bool) -> Case:
    tokens = 2048 if quick else 8192  # 128 MiB or 512 MiB of bfloat16 gradExpandedX
    return make_case(tokens, 8, 4096, "bfloat16", "dropless", seed=2)


def _reference(case: Case, repeats: int) -> tuple[float, float, float]:
    x, idx = case.grad_expanded_x, case.expanded_row_idx
    out_like = np.empty((case.tokens, x.shape[-1]), x.dtype)

    def copy() -> None:
        np.copy(x)
        np.copy(out_like)

    def ref() -> np.ndarray:
        return reference.moe_init_routing_v2_grad(x, idx, case.top_k)
    ref()
    copy()
    ref_s, copy_s = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine
        ref_s.append(_seconds(ref, 1))
        copy_s.append(_seconds(copy, 1))
    tracemalloc.start()
    result = ref()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(ref_s), statistics.median(copy_s), (peak - result.nbytes) / 2**20


def _kernel(case: Case, repeats: int) -> tuple[float, float, int]:
    dev = current_device()
    x_host = case.grad_expanded_x
    with closing(Stream(dev)) as s:
        x, idx = to_device(x_host, stream=s), to_device(case.expanded_row_idx, stream=s)
        out = empty((case.tokens, x_host.shape[-1]), x_host.dtype, dev)
        moved = x.nbytes + idx.nbytes + out.nbytes
        src = np.ones(moved, np.uint8)
        dst = np.empty_like(src)
        with MoeInitRoutingV2Grad(x, idx, case.top_k, out=out) as plan, Event(dev) as a, Event(dev) as b:
            plan(s)
            s.synchronize()
            kern, copy = [], []
            for _ in range(repeats):
                a.record(s)
                plan(s)
                b.record(s)
                s.synchronize()
                kern.append(a.elapsed_ms(b) / 1e3)
                copy.append(_seconds(lambda: np.copyto(dst, src), 1))
    return statistics.median(kern), statistics.median(copy), moved


def run(quick: bool = False, log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """All figures: (the JSON dict with exactly KEYS, extra figures for the text report)."""
    say = log or (lambda _msg: None)
    batches = 11 if quick else 21
    calls = 500 if quick else 1000  # a batch stays within a stream's queue on any device
    res: dict[str, Any] = {"backend": library_info().backend}
    say("bare foreign call, raw launch, plan relaunch and one-shot call, interleaved")
    host = _host_costs(calls, batches)
    res["ffi_call_ns"], res["raw_launch_ns"], res["plan_launch_ns"] = host["ffi"], host["raw"], host["plan"]
    res["oneshot_launch_ns"], uncached_ns = host["oneshot"], host["uncached"]
    say("NumPy in, NumPy out")
    (res["numpy_call_ns"], res["numpy_copy_ns"], res["numpy_kernel_ns"],
     res["numpy_call_mallocs"]) = _numpy_path(5 if quick else 9)
    case = _big_case(quick)
    say(f"golden reference on {case.grad_expanded_x.nbytes >> 20} MiB")
    res["reference_s"], res["reference_copy_s"], peak_mib = _reference(case, 3 if quick else 5)
    say("kernel")
    res["kernel_s"], res["kernel_copy_s"], moved = _kernel(case, 3 if quick else 5)
    extra = {
        "oneshot_uncached_ns": uncached_ns,
        "input_mib": case.grad_expanded_x.nbytes / 2**20,
        "reference_peak_extra_mib": peak_mib,
        "kernel_gb_per_s": moved / res["kernel_s"] / 1e9,
        "copy_gb_per_s": moved / res["kernel_copy_s"] / 1e9,
    }
    return {k: res[k] for k in KEYS}, extra


def report(res: dict[str, Any], extra: dict[str, Any]) -> str:
    unit = res["ffi_call_ns"]
    lines = [
        f"backend                {res['backend']}",
        f"bare foreign call      {unit:10.0f} ns   (the unit)",
        f"raw launch             {res['raw_launch_ns']:10.0f} ns   {res['raw_launch_ns'] / unit:6.2f} units "
        "(one bare foreign call of the second phase: the floor)",
        f"plan relaunch          {res['plan_launch_ns']:10.0f} ns   {res['plan_launch_ns'] / unit:6.2f} units "
        f"({(res['plan_launch_ns'] - res['raw_launch_ns']) / unit:.2f} above the floor)",
        f"one-shot call          {res['oneshot_launch_ns']:10.0f} ns   {res['oneshot_launch_ns'] / unit:6.2f} units",
        f"  without the cache    {extra['oneshot_uncached_ns']:10.0f} ns   "
        f"{extra['oneshot_uncached_ns'] / unit:6.2f} units (validate=False: the first phase on every call)",
        f"NumPy call             {res['numpy_call_ns'] / 1e3:10.1f} us   (its copies alone: "
        f"{res['numpy_copy_ns'] / 1e3:.1f} us, its kernel {res['numpy_kernel_ns'] / 1e3:.1f} us; "
        f"{res['numpy_call_mallocs']:g} allocations per call)",
        f"reference              {res['reference_s'] * 1e3:10.1f} ms   copy of the same bytes "
        f"{res['reference_copy_s'] * 1e3:.1f} ms, ratio {res['reference_s'] / res['reference_copy_s']:.2f} "
        f"({extra['input_mib']:.0f} MiB input, peak extra memory {extra['reference_peak_extra_mib']:.1f} MiB)",
        f"kernel                 {res['kernel_s'] * 1e3:10.1f} ms   copy of the same bytes "
        f"{res['kernel_copy_s'] * 1e3:.1f} ms, throughput {res['kernel_copy_s'] / res['kernel_s']:.2f} of a copy "
        f"({extra['kernel_gb_per_s']:.1f} GB/s)",
        "",
    ]
    for name, (num, sub, den, factor) in TARGETS.items():
        ratio = _ratio(res, num, sub, den)
        lhs = f"{num} - {sub}" if sub else num
        lines.append(f"target {name:<16} {lhs} <= {factor:g} x {den}: {ratio:.2f} x  "
                     f"{'met' if ratio <= factor else 'MISSED'}")
    mallocs = res["numpy_call_mallocs"]
    lines.append(f"target {'NumPy allocations':<16} numpy_call_mallocs == 0: {mallocs:g}  "
                 f"{'met' if mallocs == 0 else 'MISSED'}")
    return "\n".join(lines)


def _ratio(res: dict[str, Any], num: str, sub: str | None, den: str) -> float:
    return float((res[num] - (res[sub] if sub else 0.0)) / res[den])


def targets_met(res: dict[str, Any]) -> bool:
    return res["numpy_call_mallocs"] == 0 and all(
        _ratio(res, num, sub, den) <= factor for num, sub, den, factor in TARGETS.values())
