"""DeviceArray behaves like a NumPy/CuPy array where it can: byte strides, item, reshape,
fill, copy; what it cannot do (fancy indexing, implicit conversion) is refused clearly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pyacl_moe as pm


def test_strides_are_bytes_and_element_strides_what_the_acltensor_gets(device):
    host = np.arange(60, dtype=np.float16).reshape(5, 12)
    arr = pm.to_device(host)
    assert arr.strides == host.strides == (24, 2)
    assert arr.element_strides == (12, 1)
    v = arr[:, 1::4]
    assert v.strides == host[:, 1::4].strides and v.element_strides == (12, 4)


def test_item(device):
    arr = pm.to_device(np.array([[1.5, 2.5], [3.5, 4.5]], np.float32))
    assert arr[1, 0].item() == 3.5 and type(arr[1, 0].item()) is float
    assert arr[0:1, 1:2].item() == 2.5
    with pytest.raises(pm.InvalidArgument, match="exactly one element"):
        arr.item()


def test_reshape_is_a_view_when_contiguous_and_a_copy_otherwise(device):
    host = np.arange(24, dtype=np.int32)
    arr = pm.to_device(host)
    r = arr.reshape(2, 3, 4)
    assert r.shape == (2, 3, 4) and r.data_ptr == arr.data_ptr
    np.testing.assert_array_equal(r.to_host(), host.reshape(2, 3, 4))
    assert arr.reshape((4, -1)).shape == (4, 6)
    arr.copy_from_host(host * 2)  # a view: the write shows through
    np.testing.assert_array_equal(r.to_host(), (host * 2).reshape(2, 3, 4))
    strided = r[:, :, ::2]
    c = strided.reshape(-1)
    assert c.data_ptr != arr.data_ptr and c.is_contiguous
    np.testing.assert_array_equal(c.to_host(), (host * 2).reshape(2, 3, 4)[:, :, ::2].reshape(-1))
    with pytest.raises(pm.InvalidArgument, match="shape"):
        arr.reshape(5, 5)
    with pytest.raises(pm.InvalidArgument, match="one -1"):
        arr.reshape(-1, -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int32])
def test_fill_and_copy(device, dtype):
    arr = pm.empty((3, 5), dtype)
    arr.fill(0)
    np.testing.assert_array_equal(arr.to_host(), np.zeros((3, 5), dtype))
    arr.fill(2.5 if np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16 else 7)
    want = np.full((3, 5), 2.5 if np.dtype(dtype).kind != "i" else 7, dtype)
    np.testing.assert_array_equal(arr.to_host(), want)
    c = arr.copy()
    assert c.data_ptr != arr.data_ptr
    arr.fill(0)
    np.testing.assert_array_equal(c.to_host(), want)  # the copy is its own memory
    with pytest.raises(pm.InvalidArgument, match="contiguous"):
        arr[:, ::2].fill(1)
    np.testing.assert_array_equal(arr[:, ::2].copy().to_host(), np.zeros((3, 3), dtype))


def test_fill_of_negative_zero_keeps_the_sign(device):
    arr = pm.empty((4,), np.float32)
    arr.fill(-0.0)
    assert np.signbit(arr.to_host()).all()


def test_copy_on_a_stream_follows_stream_order(device, lazy_streams):
    s = pm.Stream(device)
    arr = pm.to_device(np.arange(8, dtype=np.float32), stream=s)
    c = arr.copy(stream=s)
    assert not s.query()  # queued, not run
    np.testing.assert_array_equal(c.to_host(s), np.arange(8, dtype=np.float32))
    s.close()


@pytest.mark.parametrize("key", [np.array([0, 1]), [0, 1], np.array([True, False, True]),
                                 (slice(None), np.array([0]))])
def test_fancy_and_boolean_indexing_are_refused_clearly(device, key):
    arr = pm.to_device(np.zeros((3, 3), np.float32))
    with pytest.raises(pm.InvalidArgument, match="fancy .* boolean indexing are not supported"):
        arr[key]


def test_numpy_integer_keys_still_index(device):
    arr = pm.to_device(np.arange(9, dtype=np.float32).reshape(3, 3))
    assert arr[np.int64(1), ...].to_host().tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(pm.InvalidArgument, match="newaxis"):
        arr[None]


def test_implicit_numpy_conversion_is_refused(device):
    arr = pm.to_device(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="to_host"):
        np.asarray(arr)
    with pytest.raises(TypeError, match="to_host"):
        np.array(arr)
    with pytest.raises(ValueError, match="without a copy"):
        arr.__array__(copy=False)
    np.testing.assert_array_equal(arr.to_host(), np.ones(4, np.float32))


def test_bfloat16_is_the_ml_dtypes_scalar_type():
    assert pm.bfloat16 is ml_dtypes.bfloat16
    assert float(pm.bfloat16(1.5)) == 1.5
    assert np.dtype(pm.bfloat16).itemsize == 2
