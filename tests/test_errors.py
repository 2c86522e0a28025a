"""Statuses become exceptions with status, name, API and the vendor's message."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import errors


def test_table_names_and_classes():
    assert errors.status_name(161002) == "ACLNN_ERR_PARAM_INVALID"
    assert errors.status_name(507015) == "ACL_ERROR_RT_AICORE_EXCEPTION"
    assert errors.status_code("ACLNN_ERR_INNER_TILING_ERROR") == 561002
    assert errors.status_name(999999) == "UNKNOWN_STATUS_999999"
    assert isinstance(errors.error_for(561002, "x"), pm.AclnnError)
    assert isinstance(errors.error_for(361001, "x"), pm.AclnnError)
    assert isinstance(errors.error_for(107017, "x"), pm.AclRuntimeError)
    assert isinstance(errors.error_for(100000, "x"), pm.AclRuntimeError)
    assert issubclass(pm.AclError, RuntimeError) and issubclass(pm.InvalidArgument, ValueError)


def test_every_table_entry_has_a_distinct_name():
    names = [name for name, _ in errors._TABLE.values()]
    assert len(names) == len(set(names))


def test_exceptions_pickle():
    e = errors.error_for(161001, "api", "msg")
    e2 = pickle.loads(pickle.dumps(e))
    assert (type(e2), e2.status, e2.api, e2.message) == (pm.AclnnError, 161001, "api", "msg")
    ia = pickle.loads(pickle.dumps(pm.InvalidArgument("top_k", "must be > 0")))
    assert ia.parameter == "top_k"


def test_vendor_status_carries_api_name_and_message(device):
    x = pm.to_device(np.zeros((4, 2), np.float32))
    idx = pm.to_device(np.arange(4, dtype=np.int32))
    out = pm.empty((3, 2), np.float32)  # wrong rows: the vendor's tiling rejects it
    with pytest.raises(pm.AclnnError) as info:
        pm.moe_init_routing_v2_grad(x, idx, 2, out=out, validate=False)
    e = info.value
    assert e.status == 561002 and e.name == "ACLNN_ERR_INNER_TILING_ERROR"
    assert e.api == "aclnnMoeInitRoutingV2GradGetWorkspaceSize"
    assert "out has 3 rows" in e.message
    assert "561002" in str(e) and "CANN says" in str(e)


def test_runtime_status_is_an_acl_runtime_error(device):
    with pytest.raises(pm.AclRuntimeError) as info:
        pm.empty((1 << 40,), np.uint8)  # 1 TiB: more than the device has
    assert info.value.status == 207001 and info.value.api == "aclrtMalloc"
    assert "free" in info.value.message


def test_every_bindings_wrapper_checks_its_status(device):
    # The thin per-call functions of the bindings layer, including those nothing above uses
    # yet: each returns plain values and raises on a failure status.
    from pyacl_moe import _ffi

    assert _ffi.get_device() == 0
    host = _ffi.malloc_host(64)
    assert host != 0
    _ffi.free_host(host)
    with pytest.raises(pm.AclRuntimeError) as info:
        _ffi.free_host(host)  # twice: the vendor's status, not a crash
    assert info.value.status == 207002
    arr = pm.to_device(np.zeros(8, np.float32))
    with pm.AclTensor(arr) as t:
        _ffi.tensor_set_raw_addr(t._h, arr.data_ptr + 16)
        assert t.raw_address == arr.data_ptr + 16
