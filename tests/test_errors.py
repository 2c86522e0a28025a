"""Statuses become exceptions with status, name, API and the vendor's message."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import pyacl_moe as pm
from pyacl_moe import _status, errors


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
    assert issubclass(pm.ClosedError, pm.PyaclMoeError) and issubclass(pm.ClosedError, ValueError)
    assert not issubclass(pm.ClosedError, pm.InvalidArgument)
    assert issubclass(pm.CannNotFoundError, OSError) and issubclass(pm.CannNotFoundError, pm.PyaclMoeError)
    assert errors.is_aclnn_status(561002) and not errors.is_aclnn_status(507015)


def test_every_table_entry_has_a_distinct_name():
    names = [name for name, _ in _status.TABLE.values()]
    assert len(names) == len(set(names))


def test_exceptions_pickle():
    e = errors.error_for(161001, "api", "msg")
    e2 = pickle.loads(pickle.dumps(e))
    assert (type(e2), e2.status, e2.api, e2.message) == (pm.AclnnError, 161001, "api", "msg")
    ia = pickle.loads(pickle.dumps(pm.InvalidArgument("top_k", "must be > 0")))
    assert (ia.parameter, ia.rule, str(ia)) == ("top_k", "must be > 0", "top_k: must be > 0")
    ce = pickle.loads(pickle.dumps(pm.ClosedError("stream", "it was closed")))
    assert (type(ce), ce.what, ce.reason, str(ce)) == (pm.ClosedError, "stream", "it was closed",
                                                       "stream is closed: it was closed")
    nf = pickle.loads(pickle.dumps(pm.CannNotFoundError(["here", "there"])))
    assert nf.tried == ["here", "there"] and "  - there" in str(nf)


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
    # The thin per-call functions of the bindings layer (pyacl_moe._cann), including those
    # nothing above uses yet: each returns plain values and raises on a failure status, naming
    # the API and carrying the vendor's message.
    from pyacl_moe._cann import acl, aclnn, errcheck, loader

    assert acl.device_count() == 1 and acl.get_version() == pm.acl_version()
    free, total = acl.get_mem_info()
    assert 0 < free <= total
    mem = acl.DeviceMemory(device.context)
    ptr = acl.malloc(mem, 64)
    assert ptr != 0 and ptr == mem.address
    for call, api in ((lambda: acl.memset_async(ptr, 64, 0, 128, None), "aclrtMemsetAsync"),
                      (lambda: acl.memcpy_async(ptr, 64, ptr + 1, 128, "ACL_MEMCPY_DEVICE_TO_DEVICE", None),
                       "aclrtMemcpyAsync"),
                      (lambda: acl.synchronize_stream(None, -5), "aclrtSynchronizeStreamWithTimeout")):
        with pytest.raises(pm.AclRuntimeError) as info:
            call()
        # CANN's codes: count above destMax is the runtime's (or the driver's) 107000, and so is
        # a timeout below -1 (the ACL layer returns ACL_ERROR_RT_PARAM_INVALID).
        assert (info.value.status, info.value.api) == (107000, api) and info.value.message
    assert acl.query_stream(None) is True
    assert mem.release() == 0 and not mem
    assert mem.release() == 0  # exactly once: the second release calls nothing
    with pytest.raises(pm.AclRuntimeError) as info:
        # Freed twice behind the handle's back: the vendor's status (the driver's "address not
        # allocated", 107000), not a crash.
        errcheck.check(loader.libs().acl.aclrtFree(acl.void(ptr)), "aclrtFree")
    assert info.value.status == 107000
    arr = pm.to_device(np.zeros((8, 4), np.float32))
    with pm.AclTensor(arr) as t:
        h = t.core().handle
        assert aclnn.tensor_query(h, "RawTensorAddr") == arr.data_ptr and aclnn.tensor_query(h, "ViewShape") == (8, 4)
        size, ex = pm.get_workspace_size(t, pm.to_device(np.arange(8, dtype=np.int32)), 2, 0, 0,
                                         pm.empty((4, 4), np.float32))
        with pytest.raises(pm.AclnnError) as info:
            aclnn.set_input_addr(ex.core().handle, 7, h, arr.data_ptr)  # no input 7
        assert info.value.api == "aclSetInputTensorAddr" and info.value.status == 161002
        ex.close()
