"""aclTensor handles over DeviceArrays.

An :class:`AclTensor` describes a DeviceArray to CANN exactly as it is: view shape, element
strides, element offset from the storage base, and the storage base address. A non-contiguous
view becomes a strided aclTensor, never a hidden copy. The handle is destroyed once neither the
AclTensor nor an executor built from it holds it (``close()`` drops the AclTensor's hold).
"""

from __future__ import annotations

from . import _args
from ._cann import aclnn, declare
from .array import DeviceArray
from .device import TENSORS, Allocation, Holder, collect
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
        aclnn.create_tensor(self.holder.handle, array.tensor_desc(), alloc.ptr, fmt)  # type: ignore[arg-type]

    @property
    def handle(self) -> aclnn.TensorHandle:
        return self.holder.handle  # type: ignore[return-value]


class AclTensor:
    """An aclTensor describing ``array`` (which it keeps alive while the handle lives).

    ``fmt`` is an aclFormat code (default ND). ``close()`` (or ``with``) is aclDestroyTensor,
    at once unless an executor still uses it."""

    __slots__ = ("_core", "_array", "__weakref__")

    def __init__(self, array: DeviceArray, fmt: int | None = None) -> None:
        _args.instance("array", array, DeviceArray, "a DeviceArray")
        code = declare.const("ACL_FORMAT_ND") if fmt is None else _args.int32("fmt", fmt)
        collect()
        self._array = array
        self._core: TensorCore | None = None
        self._core = TensorCore(array, code)

    def core(self, what: str = "tensor") -> TensorCore:
        """The handle's owner, checked open (for pyacl_moe's own layers)."""
        c = self._core
        if c is None or c.device.closed:
            raise ClosedError(what, "the AclTensor was closed" if c is None else
                              f"its device {c.device.device_id} was closed")
        return c

    @property
    def handle(self) -> int:
        """The aclTensor* as an integer (0 once closed)."""
        c = self._core
        return c.handle.address if c is not None else 0

    @property
    def array(self) -> DeviceArray:
        """The DeviceArray the tensor describes."""
        return self._array

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        c = self._core
        return c is None or c.device.closed

    # What CANN reports back: used by tests to check the descriptor is the array's.
    @property
    def view_shape(self) -> tuple[int, ...]:
        """aclGetViewShape."""
        return aclnn.tensor_query(self.core().handle, "ViewShape")  # type: ignore[no-any-return]

    @property
    def view_strides(self) -> tuple[int, ...]:
        """aclGetViewStrides (elements)."""
        return aclnn.tensor_query(self.core().handle, "ViewStrides")  # type: ignore[no-any-return]

    @property
    def view_offset(self) -> int:
        """aclGetViewOffset (elements)."""
        return aclnn.tensor_query(self.core().handle, "ViewOffset")  # type: ignore[no-any-return]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """aclGetStorageShape."""
        return aclnn.tensor_query(self.core().handle, "StorageShape")  # type: ignore[no-any-return]

    @property
    def data_type(self) -> int:
        """aclGetDataType: the aclDataType code."""
        return aclnn.tensor_query(self.core().handle, "DataType")  # type: ignore[no-any-return]

    @property
    def format(self) -> int:
        """aclGetFormat: the aclFormat code."""
        return aclnn.tensor_query(self.core().handle, "Format")  # type: ignore[no-any-return]

    @property
    def raw_address(self) -> int:
        """aclGetRawTensorAddr: the storage base address CANN holds."""
        return aclnn.tensor_query(self.core().handle, "RawTensorAddr")  # type: ignore[no-any-return]

    def rebound(self, array: DeviceArray) -> None:
        """Point the wrapper at ``array`` after CANN was told its new address (a plan's rebind)."""
        self._array = array

    def close(self) -> None:
        """Drop this tensor's hold on the handle: destroyed at once unless an executor still
        uses it; CANN's refusal is raised. Safe twice."""
        core, self._core = self._core, None
        if core is not None:
            device, holder = core.device, core.holder
            del core
            device.release_if_gone(holder)

    def __enter__(self) -> AclTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        a = self._array
        return (f"<AclTensor {self.handle:#x} shape={a.shape} dtype={a.dtype} element_strides={a.element_strides} "
                f"offset={a.offset}>")
