"""aclTensor handles over DeviceArrays.

An :class:`AclTensor` describes a DeviceArray to CANN exactly as it is: view shape, element
strides, element offset from the storage base, and the storage base address. A non-contiguous
view becomes a strided aclTensor, never a hidden copy. The handle is destroyed by ``close()``
(or the context manager) deterministically, and by a finalizer as a last resort.
"""

from __future__ import annotations

from typing import Any

from . import _ffi
from .memory import DeviceArray

__all__ = ["AclTensor"]


def _destroy(handle: Any) -> None:
    try:
        _ffi.destroy_tensor(handle)
    except Exception:
        pass


class AclTensor:
    """An aclTensor describing ``array`` (which it keeps alive while the handle lives)."""

    __slots__ = ("_h", "_array", "__weakref__")

    def __init__(self, array: DeviceArray, fmt: int = _ffi.ACL_FORMAT_ND) -> None:
        if not isinstance(array, DeviceArray):
            raise TypeError(f"AclTensor needs a DeviceArray, got {type(array).__name__}")
        self._array = array
        self._h = None
        self._h = _ffi.create_tensor_from_desc(array._tensor_desc(), array._live_alloc().ptr, fmt)

    @property
    def handle(self) -> int:
        """The aclTensor* as an integer (0 once closed)."""
        return _ffi.address(self._h) if self._h is not None else 0

    @property
    def array(self) -> DeviceArray:
        return self._array

    @property
    def closed(self) -> bool:
        return self._h is None

    def _use(self) -> Any:
        if self._h is None:
            raise ValueError("the AclTensor is closed")
        return self._h

    # What CANN reports back: used by tests to check the descriptor is the array's.
    @property
    def view_shape(self) -> tuple[int, ...]:
        return _ffi.tensor_view_shape(self._use())

    @property
    def view_strides(self) -> tuple[int, ...]:
        return _ffi.tensor_view_strides(self._use())

    @property
    def view_offset(self) -> int:
        return _ffi.tensor_view_offset(self._use())

    @property
    def storage_shape(self) -> tuple[int, ...]:
        return _ffi.tensor_storage_shape(self._use())

    @property
    def data_type(self) -> int:
        return _ffi.tensor_data_type(self._use())

    @property
    def format(self) -> int:
        return _ffi.tensor_format(self._use())

    @property
    def raw_address(self) -> int:
        return _ffi.tensor_raw_addr(self._use())

    def _rebind(self, array: DeviceArray) -> None:
        """Point the wrapper at ``array`` after CANN was told its new address."""
        self._array = array

    def close(self) -> None:
        """aclDestroyTensor. Safe twice."""
        h, self._h = self._h, None
        if h is not None:
            _ffi.destroy_tensor(h)

    def __enter__(self) -> AclTensor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        h = getattr(self, "_h", None)
        if h is not None:
            self._h = None
            _destroy(h)

    def __repr__(self) -> str:
        a = self._array
        return f"<AclTensor {self.handle:#x} shape={a.shape} dtype={a.dtype} strides={a.strides} offset={a.offset}>"
