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
import struct
import sys
import types
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgument

__all__ = ["Family", "host_view", "in_family"]

_BF16 = np.dtype(ml_dtypes.bfloat16)

# DLPack's C layout (dlpack.h, version 0.x: the unversioned capsule every producer still gives
# when asked without max_version): a DLTensor is its data pointer, device (type, id), ndim,
# dtype (code, bits, lanes), shape and strides pointers and byte_offset, with C's alignment.
_DL_TENSOR = struct.Struct("PiiiBBHPPQ")
_DL_CPU, _DL_CPU_PINNED = 1, 3
_INT64S = ctypes.POINTER(ctypes.c_int64)

_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))

# (DLPack's type code, bits) -> the dtype: the codes by NumPy's kinds, kDLBfloat (4) bfloat16's.
_KINDS = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_CODES = {(_KINDS[d.kind], 8 * d.itemsize): d
          for d in map(np.dtype, "i1 i2 i4 i8 u1 u2 u4 u8 f2 f4 f8 c8 c16 ?".split())}
_CODES[4, 16] = _BF16


def _from_dlpack(obj: Any, name: str) -> np.ndarray:
    """A NumPy view of the host memory of a DLPack producer ``obj`` (its refusal, BufferError by
    the protocol, some producers raising others, turned into one naming the parameter) or of
    an unconsumed ``dltensor`` capsule."""
    try:
        capsule = obj.__dlpack__() if hasattr(obj, "__dlpack__") else obj
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgument(name, f"cannot export its memory through DLPack ({type(obj).__name__}: {exc})") from None
    if not _capsule_valid(capsule, b"dltensor"):
        raise InvalidArgument(name, "is a DLPack capsule that was already consumed (or is not a 'dltensor' capsule)")
    # DLManagedTensor starts with its DLTensor: the capsule's pointer is the DLTensor's address.
    data, device_type, _, ndim, code, bits, lanes, shape, strides, offset = _DL_TENSOR.unpack(
        ctypes.string_at(_capsule_pointer(capsule, b"dltensor"), _DL_TENSOR.size))
    if device_type not in (_DL_CPU, _DL_CPU_PINNED):
        raise InvalidArgument(name, f"is a DLPack tensor on device type {device_type}, not host memory: "
                                    "wrap device memory with pm.from_torch or pm.from_pointer")
    if lanes != 1 or (code, bits) not in _CODES:
        raise InvalidArgument(name, f"has a DLPack dtype (code {code}, {bits} bits, "
                                    f"{lanes} lanes) that CANN's tensors do not take")
    dtype = _CODES[code, bits]
    interface = {
        "version": 3,
        "shape": tuple(ctypes.cast(shape, _INT64S)[:ndim]),
        # The array interface cannot name bfloat16: view its bits as uint16, then reinterpret.
        "typestr": np.dtype(np.uint16).str if dtype == _BF16 else dtype.str,
        "data": (data + offset, False),
        # NULL strides: compact row-major, as DLPack says.
        "strides": tuple(s * dtype.itemsize for s in ctypes.cast(strides, _INT64S)[:ndim]) if strides else None,
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
        return _from_dlpack(obj.detach().resolve_conj().resolve_neg(), name), TORCH
    # A capsule, or a DLPack producer that NumPy does not read itself.
    if type(obj).__name__ == "PyCapsule" or (hasattr(obj, "__dlpack__") and not hasattr(obj, "__array_interface__")
                                             and not hasattr(obj, "__array__")):
        dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (_DL_CPU, 0)
        if int(dev[0]) not in (_DL_CPU, _DL_CPU_PINNED):
            raise InvalidArgument(name, f"is a DLPack tensor on device type {int(dev[0])}, not host memory")
        return _from_dlpack(obj, name), NUMPY
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(name, f"must be a host array (NumPy, buffer, array interface or DLPack), "
                                    f"got {type(obj).__name__}: {exc}") from None
    if arr.dtype == object:
        raise InvalidArgument(name, f"must be an array of numbers, got {type(obj).__name__} (dtype object)")
    return arr, NUMPY


def in_family(result: np.ndarray, family: Family) -> Any:
    """``result`` as the caller's family has it: a torch tensor for torch inputs (same dtype,
    bfloat16 included, sharing the NumPy array's memory), else the NumPy array."""
    if family != TORCH:
        return result
    torch = sys.modules["torch"]
    if result.dtype == _BF16:
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)
