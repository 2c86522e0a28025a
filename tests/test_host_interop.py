"""Host tensors of other libraries in, results back in the caller's family: torch CPU tensors
(bfloat16 included), DLPack producers and capsules, buffer and array-interface objects."""

from __future__ import annotations

import array

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import reference
from pyacl_moe.host import host_view

from . import children
from .conftest import run_isolated

torch = pytest.importorskip("torch", reason="torch (CPU build) is a test extra: pip install torch==2.13.0+cpu")


def _case(dtype: object, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 16)).astype(dtype)
    idx = rng.permutation(24).astype(np.int32)
    return x, idx


@pytest.mark.parametrize("np_dtype,torch_dtype", [(ml_dtypes.bfloat16, "bfloat16"), (np.float16, "float16"),
                                                  (np.float32, "float32")])
def test_a_torch_tensor_in_gives_a_torch_tensor_out(device, np_dtype, torch_dtype):
    x, idx = _case(np_dtype)
    tdt = getattr(torch, torch_dtype)
    tx = torch.from_numpy(x.view(np.int16)).view(tdt) if np_dtype is ml_dtypes.bfloat16 else torch.from_numpy(x)
    ti = torch.from_numpy(idx)
    got = pm.moe_init_routing_v2_grad(tx, ti, 2)
    assert isinstance(got, torch.Tensor) and got.dtype == tdt and tuple(got.shape) == (12, 16)
    expected = reference.moe_init_routing_v2_grad(x, idx, 2)
    as_np = got.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if tdt is torch.bfloat16 else got.numpy()
    np.testing.assert_array_equal(as_np, expected)


def test_torch_views_and_out(device):
    x, idx = _case(np.float32, 1)
    big = torch.from_numpy(np.ascontiguousarray(np.concatenate([x, x], axis=1)))
    tx = big[:, :16]  # a strided view: read through its strides, no copy by torch
    out = torch.empty((12, 16), dtype=torch.float32)
    r = pm.moe_init_routing_v2_grad(tx, torch.from_numpy(idx), 2, out=out)
    assert r is out
    np.testing.assert_array_equal(out.numpy(), reference.moe_init_routing_v2_grad(x, idx, 2))


def test_to_device_takes_a_bfloat16_torch_tensor(device):
    x, _ = _case(ml_dtypes.bfloat16, 2)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    d = pm.to_device(t)
    assert d.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(d.to_host(), x)


def test_a_dlpack_only_object_and_a_capsule_are_accepted(device):
    x, idx = _case(ml_dtypes.bfloat16, 2)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)

    class DLPackOnly:
        """Exposes nothing but the DLPack protocol (as array libraries without NumPy support do)."""

        def __init__(self, t: object) -> None:
            self._t = t

        def __dlpack__(self, stream: object = None) -> object:
            return self._t.__dlpack__()

        def __dlpack_device__(self) -> tuple[int, int]:
            return self._t.__dlpack_device__()

    expected = reference.moe_init_routing_v2_grad(x, idx, 2)
    got = pm.moe_init_routing_v2_grad(DLPackOnly(tx), DLPackOnly(torch.from_numpy(idx)), 2)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, expected)
    from torch.utils import dlpack
    got = pm.moe_init_routing_v2_grad(dlpack.to_dlpack(tx), idx, 2)
    np.testing.assert_array_equal(got, expected)


def test_a_consumed_capsule_is_refused(device):
    from torch.utils import dlpack
    cap = dlpack.to_dlpack(torch.zeros(4))
    torch.from_dlpack(cap)  # consumes it
    with pytest.raises(pm.InvalidArgument, match="already consumed"):
        host_view(cap, "grad_expanded_x")


def test_the_view_keeps_the_producer_memory_alive():
    t = torch.arange(6, dtype=torch.float32)
    v, _ = host_view(t, "x")
    del t
    import gc
    gc.collect()
    np.testing.assert_array_equal(v, np.arange(6, dtype=np.float32))
    v[0] = 10.0  # writable: same memory as the tensor, no copy


def test_buffer_and_array_interface_objects(device):
    idx = array.array("i", [1, 0, 3, 2])
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    got = pm.moe_init_routing_v2_grad(memoryview(x), idx, 1)
    np.testing.assert_array_equal(got, x[[1, 0, 3, 2]])


def test_bad_host_inputs_name_the_parameter(device):
    with pytest.raises(pm.InvalidArgument, match="grad_expanded_x.*dtype object"):
        pm.moe_init_routing_v2_grad([object()], np.zeros(1, np.int32), 1)
    with pytest.raises(pm.InvalidArgument, match="grad_expanded_x.*torch tensor on meta"):
        pm.moe_init_routing_v2_grad(torch.empty(4, 2, device="meta"), np.zeros(4, np.int32), 1)


def test_numpy_inputs_never_import_torch():
    r = run_isolated(children.child_numpy_inputs_import_no_torch, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_from_torch_refuses_host_tensors_and_non_tensors(device):
    with pytest.raises(pm.InvalidArgument, match="tensor.*is on cpu.*pass host tensors"):
        pm.from_torch(torch.zeros(4))
    with pytest.raises(pm.InvalidArgument, match="must be a torch tensor"):
        pm.from_torch(np.zeros(4))


@pytest.mark.cann
def test_from_torch_wraps_an_npu_tensor_on_torch_npus_stream():
    torch_npu = pytest.importorskip("torch_npu")
    x, idx = _case(np.float32, 4)
    tx, ti = torch.from_numpy(x).npu(), torch.from_numpy(idx).npu()
    view = tx[:, :8]
    dx = pm.from_torch(view)
    assert dx.shape == (24, 8) and dx.strides == (64, 4) and dx.address == view.data_ptr()
    s = pm.Stream.from_handle(torch_npu.npu.current_stream().npu_stream, device=tx.device.index)
    out = pm.moe_init_routing_v2_grad(pm.from_torch(tx), pm.from_torch(ti), 2, stream=s)
    np.testing.assert_array_equal(out.to_host(s), reference.moe_init_routing_v2_grad(x, idx, 2))


def test_a_tensor_that_cannot_export_its_memory_is_refused_by_parameter_name(device):
    idx = torch.arange(8, dtype=torch.int32)
    sparse = torch.ones(8, 4).to_sparse()
    with pytest.raises(pm.InvalidArgument, match=r"grad_expanded_x: .*layout torch.sparse_coo.*to_dense\(\)"):
        pm.moe_init_routing_v2_grad(sparse, idx, 1)
    with pytest.raises(pm.InvalidArgument, match=r"x: .*layout torch.sparse_coo"):
        pm.moe_init_routing_v2(torch.ones(8, 4).to_sparse(), idx.reshape(8, 1), expert_num=8)

    class Refuses:  # a DLPack producer whose memory cannot be exported (the protocol's BufferError)
        def __dlpack__(self, **kwargs):
            raise BufferError("this buffer is not exportable")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(pm.InvalidArgument, match="expanded_row_idx: cannot export its memory through DLPack"):
        pm.moe_init_routing_v2_grad(torch.ones(8, 4), Refuses(), 1)
