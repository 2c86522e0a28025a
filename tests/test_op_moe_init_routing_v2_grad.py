"""aclnnMoeInitRoutingV2Grad through the one-call function: NumPy and device arrays, out and
workspace, host validation and the vendor's own checks. The two phases by hand are in
test_op_executor.py, prepared plans and the executor cache in test_op_plan.py."""

from __future__ import annotations

from contextlib import closing

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe.tools.cases import compare, make_case

DTYPES = ["float32", "float16", "bfloat16"]
MODES = ["dropless", "active", "drop-pad"]


def loop_reference(case) -> np.ndarray:
    """Per-token Python loop: the definition, written as plainly as possible."""
    x, idx, k = case.grad_expanded_x, case.expanded_row_idx, case.top_k
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    n = idx.size // k
    out = np.zeros((n, x.shape[-1]), np.float32)
    for i in range(n):
        for t in range(k):
            j = int(idx[i * k + t])
            if case.drop_pad_mode == 1 and j == -1:
                continue
            if case.drop_pad_mode == 0 and case.active_num > 0 and j >= case.active_num:
                continue
            out[i] += rows[j]
    return out.astype(x.dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_in_numpy_out(device, mode, dtype, no_leaks):
    case = make_case(24, 4, 33, dtype, mode, seed=7)
    got = pm.moe_init_routing_v2_grad(*case.args())
    assert isinstance(got, np.ndarray) and got.dtype == case.grad_expanded_x.dtype
    assert compare(got, loop_reference(case)).passed


@pytest.mark.parametrize("mode", MODES)
def test_device_arrays_run_asynchronously(device, mode, lazy_streams, no_leaks):
    case = make_case(16, 2, 8, "float32", mode, seed=3)
    with closing(pm.Stream(device)) as s:
        x = pm.to_device(case.grad_expanded_x, stream=s)
        idx = pm.to_device(case.expanded_row_idx, stream=s)
        pending = pm.emulator.stats()["pending_tasks"]
        out = pm.moe_init_routing_v2_grad(x, idx, case.top_k, case.drop_pad_mode, case.active_num, stream=s)
        assert isinstance(out, pm.DeviceArray)
        assert pm.emulator.stats()["pending_tasks"] > pending  # queued, not run
        assert out.shape == (16, 8) and out.dtype == np.float32 and out.device is device
        np.testing.assert_allclose(out.to_host(), loop_reference(case), rtol=1e-5, atol=1e-6)


def test_out_and_workspace_are_used(device, no_leaks):
    case = make_case(8, 2, 16, "bfloat16", "dropless", seed=1)
    x, idx = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    out = pm.empty((8, 16), ml_dtypes.bfloat16)
    ws = pm.empty((16 << 20,), np.uint8)
    mallocs = pm.emulator.stats()["mallocs_total"]
    result = pm.moe_init_routing_v2_grad(x, idx, 2, out=out, workspace=ws)
    assert result is out
    assert pm.emulator.stats()["mallocs_total"] == mallocs  # nothing allocated: out and workspace given
    np.testing.assert_array_equal(out.to_host(), loop_reference(case))
    with pytest.raises(pm.InvalidArgument, match="workspace"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out, workspace=pm.empty((100,), np.uint8))


def test_numpy_out_parameter(device):
    case = make_case(8, 2, 4, "float32", "dropless", seed=2)
    out = np.empty((8, 4), np.float32)
    assert pm.moe_init_routing_v2_grad(*case.args(), out=out) is out
    np.testing.assert_allclose(out, loop_reference(case), rtol=1e-5, atol=1e-6)
    with pytest.raises(pm.InvalidArgument, match="out"):
        ro = np.empty((8, 4), np.float32)
        ro.flags.writeable = False
        pm.moe_init_routing_v2_grad(*case.args(), out=ro)


def test_a_host_out_that_is_not_what_the_op_writes_is_refused_with_validate_false_too(device, no_leaks):
    """The NumPy call copies its result back from the output it makes on the device: an out of
    another size was copied from past the end of that block (the emulator refused the copy;
    CANN would read the memory beyond), validate or not."""
    case = make_case(8, 2, 4, "float32", "dropless", seed=2)
    for wrong in (np.empty((16, 4), np.float32), np.empty((8, 4), np.float64), np.empty((4, 4), np.float32)):
        with pytest.raises(pm.InvalidArgument, match=r"^out: must have shape \(8, 4\) and dtype float32"):
            pm.moe_init_routing_v2_grad(*case.args(), out=wrong, validate=False)
    out = np.empty((8, 4), np.float32)
    assert pm.moe_init_routing_v2_grad(*case.args(), out=out, validate=False) is out
    np.testing.assert_allclose(out, loop_reference(case), rtol=1e-5, atol=1e-6)


def test_non_contiguous_inputs_are_honoured(device, no_leaks):
    case = make_case(12, 3, 10, "float32", "dropless", seed=5)
    wide = np.zeros((36, 30), np.float32)
    wide[:, 5:25:2] = case.grad_expanded_x
    idx_wide = np.full(72, 999, np.int32)
    idx_wide[1::2] = case.expanded_row_idx
    x = pm.to_device(wide)[:, 5:25:2]
    idx = pm.to_device(idx_wide)[1::2]
    assert not x.is_contiguous and not idx.is_contiguous and x.offset == 5
    out = pm.moe_init_routing_v2_grad(x, idx, 3)
    np.testing.assert_allclose(out.to_host(), loop_reference(case), rtol=1e-5, atol=1e-6)


def test_vendor_checks_with_validate_false(device):
    x = pm.empty((8, 4), np.float64)  # ACL_DOUBLE: the vendor refuses it
    idx = pm.empty((8,), np.int32)
    with pytest.raises(pm.AclnnError) as info:
        pm.moe_init_routing_v2_grad(x, idx, 2, validate=False)
    assert info.value.status == 161002
    with pytest.raises(pm.AclnnError) as info:  # NumPy in: the same vendor check
        pm.moe_init_routing_v2_grad(np.zeros((8, 4), np.float32), np.arange(8, dtype=np.int32), 3, validate=False)
    assert info.value.status == 561002


def test_argument_types_are_checked(device):
    x, idx = pm.to_device(np.zeros((8, 4), np.float32)), pm.to_device(np.arange(8, dtype=np.int32))
    for kwargs, name in ((dict(validate=1), "validate"), (dict(validate="yes"), "validate"),
                         (dict(stream=0), "stream"), (dict(workspace=b"x"), "workspace"),
                         (dict(out=np.zeros((4, 4), np.float32)), "out")):
        with pytest.raises(pm.InvalidArgument) as info:
            pm.moe_init_routing_v2_grad(x, idx, 2, **kwargs)
        assert info.value.parameter == name
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.moe_init_routing_v2_grad(np.zeros((8, 4), np.float32), np.arange(8, dtype=np.int32), 2,
                                    out=pm.empty((4, 4), np.float32))


def test_an_out_sharing_memory_with_an_input_is_refused(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=4)
    both = pm.to_device(np.concatenate([case.grad_expanded_x, np.zeros((8, 16), np.float32)]))
    x, idx = both[:16], pm.to_device(case.expanded_row_idx)
    launched = pm.emulator.stats()["kernels_launched"]
    for out in (both[8:16], both[:8], both[12:20]):
        with pytest.raises(pm.InvalidArgument, match="out: shares device memory with grad_expanded_x"):
            pm.moe_init_routing_v2_grad(x, idx, 2, out=out)
    idx_as_out = pm.DeviceArray.from_pointer(idx.data_ptr, (8, 16), np.float32, owner=idx)
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=idx_as_out)
    assert pm.emulator.stats()["kernels_launched"] == launched
    ws = pm.empty((16 << 20,), np.uint8)
    with pytest.raises(pm.InvalidArgument, match="workspace"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=pm.DeviceArray.from_pointer(ws.data_ptr, (8, 16), np.float32,
                                                                            owner=ws), workspace=ws)
    out = both[16:]  # disjoint views of one allocation are fine
    pm.moe_init_routing_v2_grad(x, idx, 2, out=out)
    np.testing.assert_array_equal(out.to_host(), loop_reference(case))


@pytest.mark.parametrize(
    "kwargs, param, text",
    [
        (dict(top_k=0), "top_k", "greater than 0"),
        (dict(top_k=3), "top_k", "divide"),
        (dict(top_k=2.0), "top_k", "int"),
        (dict(drop_pad_mode=2), "drop_pad_mode", "0"),
        (dict(active_num=-1), "active_num", "positive"),
        (dict(x=np.zeros((8, 4), np.float64)), "grad_expanded_x", "float16, bfloat16 or float32"),
        (dict(idx=np.arange(8, dtype=np.int64)), "expanded_row_idx", "int32"),
        (dict(idx=np.array([0, 1, 2, 3, 4, 5, 6, 8], np.int32)), "expanded_row_idx", "out of range"),
        (dict(idx=np.array([0, 1, 2, 3, 4, 5, 6, 6], np.int32)), "expanded_row_idx", "more than once"),
        (dict(x=np.zeros((7, 4), np.float32)), "grad_expanded_x", "rows"),
        (dict(out=np.zeros((4, 5), np.float32)), "out", "shape"),
        (dict(out=np.zeros((4, 4), np.float16)), "out", "dtype"),
    ],
)
def test_host_validation_names_parameter_and_rule(device, kwargs, param, text):
    args = dict(x=np.zeros((8, 4), np.float32), idx=np.arange(8, dtype=np.int32), top_k=2)
    args.update(kwargs)
    extra = {k: args.pop(k) for k in ("drop_pad_mode", "active_num", "out") if k in args}
    with pytest.raises(pm.InvalidArgument) as info:
        pm.moe_init_routing_v2_grad(args["x"], args["idx"], args["top_k"], **extra)
    assert info.value.parameter == param
    assert text in str(info.value)


def test_mixed_host_and_device_inputs_are_refused(device):
    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx"):
        pm.moe_init_routing_v2_grad(pm.to_device(np.zeros((4, 2), np.float32)), np.arange(4, dtype=np.int32), 2)


def test_non_contiguous_out_is_refused_on_host_and_written_densely_by_vendor(device):
    # The binding refuses a strided out. CANN does not (nnopbase checks the contiguity of
    # inputs only): its kernel writes [N, H] densely from the view's address, which is why the
    # binding refuses it.
    xs = np.arange(32, dtype=np.float32).reshape(8, 4)
    x, idx = pm.to_device(xs), pm.to_device(np.arange(8, dtype=np.int32))
    base = pm.zeros((4, 8), np.float32)
    out = base[:, ::2]
    with pytest.raises(pm.InvalidArgument, match="contiguous"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out)
    pm.moe_init_routing_v2_grad(x, idx, 2, out=out, validate=False)
    want = pm.reference.moe_init_routing_v2_grad(xs, np.arange(8, dtype=np.int32), 2)
    got = base.to_host()
    assert np.array_equal(got.ravel()[:16], want.ravel())  # dense, not the view's layout
    assert not np.array_equal(got[:, ::2], want)


def test_results_are_bit_identical_across_runs(device):
    case = make_case(64, 8, 128, "bfloat16", "drop-pad", seed=11)
    a = pm.moe_init_routing_v2_grad(*case.args())
    b = pm.moe_init_routing_v2_grad(*case.args())
    assert a.tobytes() == b.tobytes()


def test_numpy_bools_are_bools_for_validate_and_repeatable(device):
    """NumPy's bool was refused as "must be a bool, got bool" (as the forward's flags were);
    an int where a flag belongs is still refused, naming the parameter."""
    case = make_case(4, 2, 8, "float32", "dropless", seed=3)
    want = pm.moe_init_routing_v2_grad(*case.args())
    got = pm.moe_init_routing_v2_grad(*case.args(), validate=np.True_)
    assert np.array_equal(got, want)
    dx, di = pm.to_device(case.grad_expanded_x), pm.to_device(case.expanded_row_idx)
    assert np.array_equal(pm.moe_init_routing_v2_grad(dx, di, case.top_k, validate=np.False_).to_host(), want)
    with pm.MoeInitRoutingV2Grad(dx, di, case.top_k, repeatable=np.False_, validate=np.True_) as plan:
        assert np.array_equal(plan().to_host(), want)
    for name in ("validate", "repeatable"):
        with pytest.raises(pm.InvalidArgument, match="must be a bool, got int 1") as e:
            pm.MoeInitRoutingV2Grad(dx, di, case.top_k, **{name: 1})
        assert e.value.parameter == name
    with pytest.raises(pm.InvalidArgument, match="must be a bool, got int 1") as e:
        pm.moe_init_routing_v2_grad(dx, di, case.top_k, validate=1)
    assert e.value.parameter == "validate"


def test_an_out_overlapping_an_input_is_refused(device, no_leaks):
    case = make_case(8, 2, 16, "float32", "dropless", seed=12)
    expected = pm.moe_init_routing_v2_grad(*case.args())
    both = pm.to_device(np.concatenate([case.grad_expanded_x, np.zeros((8, 16), np.float32)]))
    x, idx = both[:16], pm.to_device(case.expanded_row_idx)
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.moe_init_routing_v2_grad(x, idx, 2, out=both[8:16])  # overlaps x's last 8 rows
    with pytest.raises(pm.InvalidArgument, match="out"):
        pm.MoeInitRoutingV2Grad(x, idx, 2, out=both[8:16])
    # Disjoint views of the same memory are fine.
    out = both[16:]
    pm.moe_init_routing_v2_grad(x, idx, 2, out=out)
    assert np.array_equal(out.to_host(), expected)
    with pm.MoeInitRoutingV2Grad(x, idx, 2, out=out) as plan:
        with pytest.raises(pm.InvalidArgument, match="out"):
            plan.rebind(out=both[0:8])


def test_float64_is_refused_saying_what_the_op_computes_in():
    """torch.autograd.gradcheck asks for float64: the refusal says the op computes in float16,
    bfloat16 or float32 (issue: papercuts, 11)."""
    idx = np.arange(4, dtype=np.int32)
    for call in (lambda: pm.moe_init_routing_v2_grad(np.ones((4, 8)), idx, 2),
                 lambda: pm.moe_init_routing_v2(np.ones((2, 8)), idx.reshape(2, 2), expert_num=4)):
        with pytest.raises(pm.InvalidArgument, match="the dtypes the op computes in .*gradcheck"):
            call()
