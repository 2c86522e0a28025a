"""Host buffers from any producer, and results back in the caller's family.

The NumPy paths take whatever holds host memory: NumPy arrays, objects with the buffer or
array-interface protocols, and DLPack producers on the CPU (torch CPU tensors, JAX arrays,
NumPy itself), bfloat16 included, which NumPy's own ``from_dlpack`` does not read. A legacy
DLPack capsule (``torch.utils.dlpack.to_dlpack``) is read too. Nothing is copied when the
memory is already usable: the NumPy view keeps the producer (or its capsule) alive.

A torch tensor in gives a torch tensor out, with the same dtype; torch is never imported here
unless the caller's object already comes from it.
"""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgument

__all__ = ["Family", "host_view", "in_family"]

_BF16 = np.dtype(ml_dtypes.bfloat16)

# DLPack's C layout (dlpack.h, version 0.x: the unversioned capsule every producer still gives
# when asked without max_version).
_DL_CPU, _DL_CPU_PINNED = 1, 3
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 4, 5, 6


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))

_CODES = {
    (_DL_INT, 8): np.int8, (_DL_INT, 16): np.int16, (_DL_INT, 32): np.int32, (_DL_INT, 64): np.int64,
    (_DL_UINT, 8): np.uint8, (_DL_UINT, 16): np.uint16, (_DL_UINT, 32): np.uint32, (_DL_UINT, 64): np.uint64,
    (_DL_FLOAT, 16): np.float16, (_DL_FLOAT, 32): np.float32, (_DL_FLOAT, 64): np.float64,
    (_DL_BFLOAT, 16): _BF16, (_DL_COMPLEX, 64): np.complex64, (_DL_COMPLEX, 128): np.complex128,
    (_DL_BOOL, 8): np.bool_,
}


def _from_capsule(capsule: Any, name: str) -> np.ndarray:
    """A NumPy view of an unconsumed ``dltensor`` capsule's host memory."""
    if not _capsule_valid(capsule, b"dltensor"):
        raise InvalidArgument(name, "is a DLPack capsule that was already consumed (or is not a 'dltensor' capsule)")
    # DLManagedTensor starts with its DLTensor: the capsule's pointer is the DLTensor's address.
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    if t.device.device_type not in (_DL_CPU, _DL_CPU_PINNED):
        raise InvalidArgument(name, f"is a DLPack tensor on device type {t.device.device_type}, not host memory: "
                                    "wrap device memory with pm.from_torch or pm.from_pointer")
    if t.dtype.lanes != 1 or (t.dtype.code, t.dtype.bits) not in _CODES:
        raise InvalidArgument(name, f"has a DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, "
                                    f"{t.dtype.lanes} lanes) that CANN's tensors do not take")
    dtype = np.dtype(_CODES[t.dtype.code, t.dtype.bits])
    # NULL strides: compact row-major, as DLPack says.
    strides = tuple(s * dtype.itemsize for s in t.strides[:t.ndim]) if t.strides else None
    # The array interface cannot name bfloat16: view its bits as uint16, then reinterpret.
    carrier = np.dtype(np.uint16) if dtype == _BF16 else dtype
    interface = {
        "version": 3,
        "shape": tuple(t.shape[:t.ndim]),
        "typestr": carrier.str,
        "data": ((t.data or 0) + t.byte_offset, False),
        "strides": strides,
    }
    # The view's base owns the capsule, whose destructor releases the producer's memory once the
    # view (and every view of it) is gone.
    view = np.asarray(types.SimpleNamespace(capsule=capsule, __array_interface__=interface))
    return view.view(_BF16) if dtype == _BF16 else view


# Where an input came from, so that the result goes back the same way.
Family = str
NUMPY: Family = "numpy"
TORCH: Family = "torch"


def host_view(obj: Any, name: str) -> tuple[np.ndarray, Family]:
    """A NumPy array over ``obj``'s host memory (no copy when possible), and its family."""
    if isinstance(obj, np.ndarray):
        return obj, NUMPY
    if type(obj).__name__ == "PyCapsule":
        return _from_capsule(obj, name), NUMPY
    if type(obj).__module__.partition(".")[0] == "torch" and "torch" in sys.modules:
        device = getattr(obj, "device", None)
        if getattr(device, "type", "cpu") != "cpu":
            raise InvalidArgument(name, f"is a torch tensor on {device}: wrap NPU memory with pm.from_torch(tensor) "
                                        "and pass the DeviceArray")
        layout = str(getattr(obj, "layout", "torch.strided"))
        if layout != "torch.strided":  # sparse and mkldnn tensors have no strided memory to read
            raise InvalidArgument(name, f"is a torch tensor of layout {layout}, which has no dense memory to read: "
                                        "pass tensor.to_dense()")
        # (a lazily conjugated or negated view is materialized; any other comes back as it is)
        t = obj.detach().resolve_conj().resolve_neg()
        return _from_capsule(_export(t, name), name), TORCH
    if hasattr(obj, "__dlpack__") and not hasattr(obj, "__array_interface__") and not hasattr(obj, "__array__"):
        dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_DL_CPU, 0)
        if int(dev[0]) not in (_DL_CPU, _DL_CPU_PINNED):
            raise InvalidArgument(name, f"is a DLPack tensor on device type {int(dev[0])}, not host memory")
        return _from_capsule(_export(obj, name), name), NUMPY
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(name, f"must be a host array (NumPy, buffer, array interface or DLPack), "
                                    f"got {type(obj).__name__}: {exc}") from None
    if arr.dtype == object:
        raise InvalidArgument(name, f"must be an array of numbers, got {type(obj).__name__} (dtype object)")
    return arr, NUMPY


def _export(obj: Any, name: str) -> Any:
    """``obj.__dlpack__()``, its refusal (BufferError by the protocol; some producers raise
    others) turned into one naming the parameter."""
    try:
        return obj.__dlpack__()
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgument(name, f"cannot export its memory through DLPack ({type(obj).__name__}: {exc})") from None


def in_family(result: np.ndarray, family: Family) -> Any:
    """``result`` as the caller's family has it: a torch tensor for torch inputs (same dtype,
    bfloat16 included, sharing the NumPy array's memory), else the NumPy array."""
    if family != TORCH:
        return result
    torch = sys.modules["torch"]
    if result.dtype == _BF16:
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)
