"""aclTensor handles over DeviceArrays.

An :class:`AclTensor` describes a DeviceArray to CANN exactly as it is: view shape, element
strides, element offset from the storage base, and the storage base address. A non-contiguous
view becomes a strided aclTensor, never a hidden copy. The handle is destroyed once neither the
AclTensor nor an executor built from it holds it (``close()`` drops the AclTensor's hold).
"""

from __future__ import annotations

from typing import Any

from . import _args
from ._cann import aclnn, declare
from .array import DeviceArray
from .device import TENSORS, Allocation, Holder, Owner, collect
from .errors import ClosedError

__all__ = ["AclTensor", "TensorCore"]


class TensorCore:
    """What an AclTensor and the executors built from it hold: the handle (its device's holder)
    and the allocation it points into (None when its user keeps the memory alive itself: a
    cached executor, whose every launch holds its own arrays)."""

    __slots__ = ("holder", "device", "alloc", "__weakref__")

    def __init__(self, array: DeviceArray, fmt: int, keep: bool = True) -> None:
        alloc = array.allocation()
        self.device = alloc.device
        self.alloc: Allocation | None = alloc if keep else None
        self.holder = Holder(aclnn.TensorHandle(), TENSORS)
        self.device.own(self.holder, self)
        aclnn.create_tensor(self.holder.handle, array.shape, array.acl_data_type,  # type: ignore[arg-type]
                            array.element_strides, array.offset, array.storage_size, alloc.ptr, fmt)

    @property
    def handle(self) -> aclnn.TensorHandle:
        return self.holder.handle  # type: ignore[return-value]


def _reported(what: str, doc: str) -> Any:
    def get(self: AclTensor) -> Any:
        return aclnn.tensor_query(self.core().handle, what)

    get.__doc__ = doc
    return property(get)


class AclTensor(Owner):
    """An aclTensor describing ``array`` (which it keeps alive while the handle lives).

    ``fmt`` is an aclFormat code (default ND). ``close()`` (or ``with``) is aclDestroyTensor,
    at once unless an executor still uses it."""

    __slots__ = ("_core", "_array", "__weakref__")

    def __init__(self, array: DeviceArray, fmt: int | None = None) -> None:
        _args.instance("array", array, DeviceArray, "a DeviceArray")
        code = declare.const("ACL_FORMAT_ND") if fmt is None else _args.int32("fmt", fmt)
        collect()
        self._array = array
        self._core: TensorCore | None = TensorCore(array, code)

    def core(self, what: str = "tensor") -> TensorCore:
        """The handle's owner, checked open (for pyacl_moe's own layers)."""
        c = self._core
        if c is None or c.device.closed:
            raise ClosedError(what, "the AclTensor was closed" if c is None else
                              f"its device {c.device.device_id} was closed")
        return c

    @property
    def array(self) -> DeviceArray:
        """The DeviceArray the tensor describes."""
        return self._array

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        return self._core is None or self._core.device.closed

    # What CANN reports back (aclGet*): used by tests to check the descriptor is the array's.
    view_shape = _reported("ViewShape", "aclGetViewShape.")
    view_strides = _reported("ViewStrides", "aclGetViewStrides (elements).")
    view_offset = _reported("ViewOffset", "aclGetViewOffset (elements).")
    storage_shape = _reported("StorageShape", "aclGetStorageShape.")
    data_type = _reported("DataType", "aclGetDataType: the aclDataType code.")
    format = _reported("Format", "aclGetFormat: the aclFormat code.")
    raw_address = _reported("RawTensorAddr", "aclGetRawTensorAddr: the storage base address CANN holds.")

    def rebound(self, array: DeviceArray) -> None:
        """Point the wrapper at ``array`` after CANN was told its new address (a plan's rebind)."""
        self._array = array

    def __repr__(self) -> str:
        a = self._array
        return (f"<AclTensor {self.handle:#x} shape={a.shape} dtype={a.dtype} element_strides={a.element_strides} "
                f"offset={a.offset}>")
