"""Device memory: :class:`DeviceArray` and the copies between host and device.

A DeviceArray is a typed, strided view (element strides and offset, as aclCreateTensor takes
them) of a device allocation, which it owns (aclrtMalloc/aclrtFree) or borrows
(``DeviceArray.from_pointer``). Basic slicing gives views that share the allocation. The memory
is freed once no array views it and no queued work uses it, or when its device closes.

Copies follow stream order: a copy on a stream holds its host buffer and the allocation until
it has run; reading back defaults to the stream that last wrote the memory; writing from the
host waits for (or, on a stream, is ordered after) queued work that uses the memory.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import _args, _lifetime
from ._cann import acl, aclnn, declare
from .allocator import Allocation, allocate, borrowed, is_pinned, on_memory_pressure, pinned_block
from .device import Device, resolve_device
from .errors import ClosedError, InvalidArgument
from .host import host_view
from .stream import Event, Stream, StreamState, active_stream, check_written, resolve_stream

__all__ = ["Allocation", "DeviceArray", "acl_data_type", "allocate", "bfloat16", "contiguous_layout", "copy_in_native",
           "empty", "empty_from", "from_pointer", "from_torch", "host_array", "may_overlap", "new_empty",
           "on_memory_pressure", "to_device", "zeros"]

#: ml_dtypes' bfloat16 scalar type (``pm.bfloat16(1.5)``, ``x.astype(pm.bfloat16)``).
bfloat16 = ml_dtypes.bfloat16

# numpy dtype -> the aclDataType it is (values read from headers/).
_ACL_NAMES: dict[np.dtype, str] = {
    np.dtype(np.float32): "ACL_FLOAT",
    np.dtype(np.float16): "ACL_FLOAT16",
    np.dtype(np.int8): "ACL_INT8",
    np.dtype(np.int32): "ACL_INT32",
    np.dtype(np.uint8): "ACL_UINT8",
    np.dtype(np.int16): "ACL_INT16",
    np.dtype(np.uint16): "ACL_UINT16",
    np.dtype(np.uint32): "ACL_UINT32",
    np.dtype(np.int64): "ACL_INT64",
    np.dtype(np.uint64): "ACL_UINT64",
    np.dtype(np.float64): "ACL_DOUBLE",
    np.dtype(np.bool_): "ACL_BOOL",
    np.dtype(np.complex64): "ACL_COMPLEX64",
    np.dtype(np.complex128): "ACL_COMPLEX128",
    np.dtype(bfloat16): "ACL_BF16",
}

_codes: dict[np.dtype, int] = {}  # _ACL_NAMES' codes, built whole at the first call (then only read)


def acl_data_type(dtype: Any) -> int:
    """The aclDataType code of a numpy dtype; InvalidArgument if CANN has none."""
    global _codes
    code = _codes.get(dtype)
    if code is not None:
        return code
    if not _codes:
        _codes = {dt: declare.const(name) for dt, name in _ACL_NAMES.items()}
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument("dtype", f"{dtype!r} is not a numpy dtype") from None
    name = _ACL_NAMES.get(dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt)
    if name is None:
        supported = ", ".join(sorted(str(d) for d in _ACL_NAMES))
        raise InvalidArgument("dtype", f"{dt} has no CANN data type (supported: {supported})")
    return declare.const(name)


def _span(base: int, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, item: int) -> tuple[int, int]:
    lo = base + offset * item
    extent = 0
    for n, s in zip(shape, strides):
        if not n:
            return (lo, lo - 1)
        extent += (n - 1) * s
    return (lo, lo + extent * item + item - 1)


# layout -> its id, a cheap key for the caches of executors and checks. Bounded: when full it
# starts over (ids are never reused, so a layout seen again gets a new id, and its caches a
# miss). ``_layout_ids`` is published whole: readers take it without a lock and see a
# complete dict that never changes; a new layout (rare) is added to a copy under
# ``_layout_lock``, which also guards ``_layout_counter``.
_layout_lock = threading.Lock()
_layout_ids: dict[tuple[Any, ...], int] = {}
_layout_counter = itertools.count()
_LAYOUTS_MAX = 1024


def _layout_id(layout: tuple[Any, ...]) -> int:
    got = _layout_ids.get(layout)
    if got is not None:
        return got
    return _new_layout_id(layout)


def _new_layout_id(layout: tuple[Any, ...]) -> int:
    global _layout_ids
    with _layout_lock:
        got = _layout_ids.get(layout)
        if got is None:
            ids = dict(_layout_ids) if len(_layout_ids) < _LAYOUTS_MAX else {}
            got = ids[layout] = next(_layout_counter)
            _layout_ids = ids
        return got


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


class DeviceArray:
    """An n-dimensional array in device memory.

    ``shape``, ``dtype`` and ``strides`` (in bytes) as in NumPy and CuPy; ``element_strides``
    and ``offset`` are in elements, as aclCreateTensor takes them. Create one with
    :func:`to_device`, :func:`empty`, :func:`zeros` or :func:`from_pointer`; read it back with
    :meth:`to_host`. NumPy never converts one implicitly: the copy and its wait are explicit.
    """

    __slots__ = ("alloc", "_shape", "_dtype", "_strides", "_offset", "_acl_dtype", "_desc", "_layout", "span",
                 "layout_id", "whole", "__weakref__")

    def __init__(self, alloc: Allocation, shape: tuple[int, ...], dtype: np.dtype, strides: tuple[int, ...],
                 offset: int, known: tuple[int, int, int] | None = None) -> None:
        # ``known``: a new contiguous array's (layout id, aclDataType code, nbytes), already
        # looked up (contiguous_layout): the view is all of ``alloc``.
        #: the Allocation the view is of (None once closed); see :meth:`allocation` for a checked one
        self.alloc: Allocation | None = alloc
        self._shape = shape
        self._dtype = dtype
        self._strides = strides
        self._offset = offset
        self._acl_dtype = acl_data_type(dtype) if known is None else known[1]
        self._desc: aclnn.TensorDesc | None = None
        self._layout = (shape, dtype, strides)
        # Read on every launch, so plain attributes rather than properties.
        #: (first, last) device byte addresses the view touches (last < first when empty).
        self.span = (_span(alloc.ptr, shape, strides, offset, dtype.itemsize) if known is None else
                     (alloc.ptr, alloc.ptr + known[2] - 1))
        #: a small int naming :attr:`layout` in this process (equal ids, equal layouts): a cheap
        #: key for caches of executors and checks.
        self.layout_id = _layout_id(self._layout) if known is None else known[0]
        #: whether the view covers its allocation's every byte: a write through it then
        #: replaces what the binding knows of the memory's latest write (the fault rule)
        self.whole = known is not None or (self.span[0] == alloc.ptr and
                                           self.span[1] - self.span[0] + 1 == alloc.nbytes)

    # -- for pyacl_moe's own layers

    def allocation(self, what: str = "array") -> Allocation:
        """The allocation this array views, checked alive (ClosedError otherwise)."""
        a = self.alloc
        if a is None or a.device.closed:
            raise ClosedError(what, "this DeviceArray was closed" if a is None else
                              f"its memory went with device {a.device.device_id}, which was closed")
        return a

    def tensor_desc(self) -> aclnn.TensorDesc:
        """What aclCreateTensor needs for this view, built once."""
        d = self._desc
        if d is None:
            a = self.allocation()
            d = self._desc = aclnn.TensorDesc(self._shape, self._acl_dtype, self._strides, self._offset,
                                              (a.nbytes // self._dtype.itemsize,))
        return d

    # -- construction

    @classmethod
    def from_pointer(cls, ptr: int, shape: Sequence[int], dtype: Any, strides: Sequence[int] | None = None,
                     offset: int = 0, owner: Any = None, device: Device | int | None = None) -> DeviceArray:
        """Same as :func:`from_pointer`."""
        return from_pointer(ptr, shape, dtype, strides, offset, owner, device)

    # -- properties

    @property
    def device(self) -> Device:
        """The device the memory is on."""
        return self.allocation().device

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, as in NumPy."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The element type, as in NumPy (bfloat16 is ml_dtypes.bfloat16)."""
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in bytes, as NumPy and CuPy have them."""
        item = self._dtype.itemsize
        return tuple(s * item for s in self._strides)

    @property
    def element_strides(self) -> tuple[int, ...]:
        """Strides in elements: what the aclTensor of the view gets (aclCreateTensor's unit)."""
        return self._strides

    @property
    def offset(self) -> int:
        """Offset of the first element from the storage base, in elements."""
        return self._offset

    @property
    def layout(self) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
        """(shape, dtype, element strides): what an aclTensor of the view depends on, its
        address aside."""
        return self._layout

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (not of the storage)."""
        return self.size * self.itemsize

    @property
    def acl_data_type(self) -> int:
        """The aclDataType code of the dtype."""
        return self._acl_dtype

    @property
    def data_ptr(self) -> int:
        """The storage base address (what aclCreateTensor receives as tensorData)."""
        return self.allocation().ptr

    @property
    def address(self) -> int:
        """The device address of the first element."""
        return self.allocation().ptr + self._offset * self._dtype.itemsize

    @property
    def storage_size(self) -> int:
        """Elements in the underlying storage."""
        return self.allocation().nbytes // self._dtype.itemsize

    @property
    def owns_memory(self) -> bool:
        """False for memory borrowed through from_pointer."""
        return self.allocation().owned

    @property
    def is_contiguous(self) -> bool:
        """True when the view is C-contiguous."""
        return _is_contiguous(self._shape, self._strides)

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        a = self.alloc
        return a is None or a.device.closed

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self._shape[0]

    def __repr__(self) -> str:
        if self.closed:
            return f"<DeviceArray closed shape={self._shape} dtype={self._dtype}>"
        return (
            f"<DeviceArray shape={self._shape} dtype={self._dtype} element_strides={self._strides} "
            f"offset={self._offset} device={self.device.device_id} address={self.address:#x}>"
        )

    # -- views

    def __getitem__(self, key: Any) -> DeviceArray:
        """Basic slicing (ints, slices with positive steps, Ellipsis): a view, no copy. Fancy
        (integer-array) and boolean indexing are refused: they copy, which a view cannot."""
        alloc = self.allocation()
        if not isinstance(key, tuple):
            key = (key,)
        for k in key:
            if isinstance(k, (DeviceArray, np.ndarray, list)) or (hasattr(k, "__array__")
                                                                  and not isinstance(k, np.generic)):
                raise InvalidArgument(
                    "key", "fancy (integer-array) and boolean indexing are not supported on a DeviceArray: they "
                           "copy, and DeviceArray indexing gives views; index the host copy (to_host()[key]) instead")
        # By identity: `in` would compare with ==, which NumPy scalars answer elementwise.
        ellipses = [i for i, k in enumerate(key) if k is Ellipsis]
        if len(ellipses) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if ellipses:
            i = ellipses[0]
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices: array is {self.ndim}-dimensional, got {len(key)}")
        shape, strides, offset = [], [], self._offset
        for d, k in enumerate(key):
            n, s = self._shape[d], self._strides[d]
            if isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
                k = int(k)
                if not -n <= k < n:
                    raise IndexError(f"index {k} is out of bounds for axis {d} with size {n}")
                offset += (k % n) * s
            elif isinstance(k, slice):
                start, stop, step = k.indices(n)
                if step <= 0:
                    raise InvalidArgument(
                        "key", "negative slice steps are not supported: CANN views take non-negative strides"
                    )
                length = max(0, (stop - start + step - 1) // step)
                if length:
                    offset += start * s
                shape.append(length)
                strides.append(s * step)
            elif k is None:
                raise InvalidArgument("key", "None (np.newaxis) is not supported: use reshape() to add an axis")
            else:
                raise InvalidArgument("key", f"only ints, slices and '...' index a DeviceArray, got {type(k).__name__}")
        shape += self._shape[len(key):]
        strides += self._strides[len(key):]
        return DeviceArray(alloc, tuple(shape), self._dtype, tuple(strides), offset)

    # -- copies

    def to_host(self, stream: Stream | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Copy to a NumPy array: a new one, or ``out``.

        With ``stream`` (or inside ``with stream:``) the copy is queued there and waited for, so
        earlier work on that stream is visible. Without, it first waits for every stream that
        queued a write to this memory through pyacl_moe, then copies.

        With ``out`` (a writable C-contiguous NumPy array of this shape and dtype) and a stream,
        the copy is queued into ``out`` and not waited for: ``out`` is complete once the stream
        has run it (``stream.synchronize()``, an event). From pinned memory
        (:func:`pinned_empty`) CANN copies asynchronously; into pageable memory
        aclrtMemcpyAsync returns once the copy is done.
        """
        alloc = self.allocation()
        if stream is None:
            stream = active_stream(alloc.device)
        if out is not None:
            return self._to_host_into(alloc, out, stream)
        out = np.empty(self._shape, dtype=self._dtype)
        lo, hi = self.span
        if hi < lo:
            return out
        nbytes = hi - lo + 1
        host = out if self.is_contiguous else np.empty(nbytes, dtype=np.uint8)
        if stream is not None:
            state = resolve_stream(stream, alloc.device)
            _order_after(alloc, state, writers_only=True)
            alloc.used_on(state, write=False)
            epoch = state.enqueue((host, alloc), acl.memcpy_async, host.ctypes.data, nbytes, lo, nbytes,
                                  "ACL_MEMCPY_DEVICE_TO_HOST")
            state.wait_for(epoch)  # a fault of the copy itself: ``host`` was not written
        else:
            _order_after(alloc, None, writers_only=True)
            alloc.device.call(acl.memcpy, host.ctypes.data, nbytes, lo, nbytes, "ACL_MEMCPY_DEVICE_TO_HOST")
        check_written(alloc.track)
        if host is not out:
            view = np.lib.stride_tricks.as_strided(
                host.view(self._dtype), shape=self._shape, strides=tuple(s * self.itemsize for s in self._strides)
            )
            out[...] = view
        return out

    def _to_host_into(self, alloc: Allocation, out: Any, stream: Stream | None) -> np.ndarray:
        if not isinstance(out, np.ndarray):
            raise InvalidArgument("out", f"must be a NumPy array, got {type(out).__name__}")
        if out.shape != self._shape or out.dtype != self._dtype:
            raise InvalidArgument("out", f"must have shape {self._shape} and dtype {self._dtype}, got "
                                         f"{out.shape} {out.dtype}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgument("out", "must be C-contiguous and writable")
        if not self.is_contiguous:
            raise InvalidArgument("array", "to_host(out=...) needs a contiguous DeviceArray (copy() it first)")
        n = self.nbytes
        if not n:
            return out
        if stream is None:
            _order_after(alloc, None, writers_only=True)
            alloc.device.call(acl.memcpy, out.ctypes.data, n, self.address, n, "ACL_MEMCPY_DEVICE_TO_HOST")
            check_written(alloc.track)
            return out
        state = resolve_stream(stream, alloc.device)
        # Queued, not waited for: a write not known clean yet is waited for now on its own
        # stream when it is another's (its fault would otherwise reach nobody).
        check_written(alloc.track, waiting=any(s is not state for s, _ in alloc.track.written))
        _order_after(alloc, state, writers_only=True)
        alloc.used_on(state, write=False)
        state.enqueue((out, alloc), acl.memcpy_async, out.ctypes.data, n, self.address, n,
                      "ACL_MEMCPY_DEVICE_TO_HOST")
        return out

    def numpy(self, stream: Stream | None = None) -> np.ndarray:
        """Same as :meth:`to_host`."""
        return self.to_host(stream)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refused: an implicit conversion would hide a device-to-host copy and a wait (as in
        CuPy). ``copy=False`` gets the ValueError NumPy 2 asks for when no view is possible."""
        if copy is False:
            raise ValueError("a DeviceArray lives in device memory: NumPy cannot view it without a copy; "
                             "use to_host() for a copy")
        raise TypeError("implicit conversion of a DeviceArray to a NumPy array is not allowed: it would copy from "
                        "the device and wait; call to_host() (or numpy()) for an explicit copy")

    def item(self) -> Any:
        """The one element of a size-1 array as a Python scalar (copied from the device)."""
        if self.size != 1:
            raise InvalidArgument("array", f"item() needs exactly one element, this array has {self.size}")
        return self.to_host().item()

    def reshape(self, *shape: Any) -> DeviceArray:
        """The same elements in another shape (one entry may be -1). A view of the same memory
        when the array is C-contiguous; otherwise a contiguous copy (see :meth:`copy`)."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        size = self.size
        dims = list(shape)
        unknown = [i for i, d in enumerate(dims) if isinstance(d, (int, np.integer)) and int(d) == -1]
        if len(unknown) > 1:
            raise InvalidArgument("shape", "can only have one -1 entry")
        if unknown:
            known = 1
            for i, d in enumerate(dims):
                if i != unknown[0]:
                    known *= _args.int64("shape", d, lo=0)
            if known == 0 or size % known:
                raise InvalidArgument("shape", f"cannot infer the -1 entry of {tuple(shape)} from {size} elements")
            dims[unknown[0]] = size // known
        shp = _args.shape("shape", dims)
        n = 1
        for d in shp:
            n *= d
        if n != size:
            raise InvalidArgument("shape", f"{shp} has {n} elements, the array {size}")
        base = self if self.is_contiguous else self.copy()
        return DeviceArray(base.allocation(), shp, self._dtype, _contiguous_strides(shp), base._offset)

    def copy(self, stream: Stream | None = None) -> DeviceArray:
        """A new contiguous DeviceArray with the same values. A contiguous array is copied on
        the device (on ``stream``, or the current stream inside ``with stream:``, else now);
        a strided one goes through the host, since CANN's runtime copies only dense bytes."""
        alloc = self.allocation()
        if not self.is_contiguous:
            return to_device(self.to_host(stream), stream=stream, device=alloc.device)
        out = empty(self._shape, self._dtype, alloc.device)
        n = self.nbytes
        if n:
            dst = out.allocation()
            if stream is None:
                stream = active_stream(alloc.device)
            # A copy of faulted memory would hand the fault's garbage on: refused.
            check_written(alloc.track, waiting=False)
            if stream is not None:
                state = resolve_stream(stream, alloc.device)
                _order_after(alloc, state, writers_only=True)
                alloc.used_on(state, write=False)
                dst.used_on(state, write=True)
                # The copy's memory is as good as its source's latest write: its mark goes on.
                state.enqueue((alloc, dst), acl.memcpy_async, dst.ptr, n, self.address, n,
                              "ACL_MEMCPY_DEVICE_TO_DEVICE", writes=((dst.track, True),))
                dst.track.written = dst.track.written + alloc.track.written
            else:
                _order_after(alloc, None, writers_only=True)
                check_written(alloc.track)
                alloc.device.call(acl.memcpy, dst.ptr, n, self.address, n, "ACL_MEMCPY_DEVICE_TO_DEVICE")
        return out

    def fill(self, value: Any, stream: Stream | None = None) -> None:
        """Set every element to ``value`` (converted to the dtype as NumPy converts it). Zero is
        a memset on the device; other values are copied from the host. Needs a contiguous
        array: a strided view shares its gaps with other views."""
        if not self.is_contiguous:
            raise InvalidArgument("array", "fill() needs a contiguous DeviceArray")
        try:
            v = np.asarray(value).astype(self._dtype, casting="unsafe")
        except (TypeError, ValueError):
            raise InvalidArgument("value", f"must convert to {self._dtype}, got {value!r}") from None
        if v.ndim:
            raise InvalidArgument("value", f"must be a scalar, got shape {v.shape}")
        alloc = self.allocation()
        if stream is None:
            stream = active_stream(alloc.device)
        n = self.nbytes
        if not n:
            return
        if not v.tobytes().strip(b"\0"):  # all-zero bits (not -0.0): a memset
            if stream is not None:
                state = resolve_stream(stream, alloc.device)
                _order_after(alloc, state)
                alloc.used_on(state, write=True)
                state.enqueue(alloc, acl.memset_async, self.address, n, 0, n, writes=((alloc.track, self.whole),))
            else:
                _order_after(alloc, None)
                alloc.device.call(acl.memset, self.address, n, 0, n)
                if self.whole:  # written now, by the host: whatever faulted before is gone
                    alloc.track.written = ()
            return
        self.copy_from_host(np.full(self._shape, v, self._dtype), stream)

    def copy_from_host(self, array: Any, stream: Stream | None = None) -> None:
        """Overwrite this (contiguous) array with ``array``'s values.

        With ``stream`` (or inside ``with stream:``) the copy is queued there, after queued work
        of other streams that uses this memory (through events); without, it waits for such
        work first, then copies.
        """
        alloc = self.allocation()
        if not self.is_contiguous:
            raise InvalidArgument("array", "copy_from_host needs a contiguous DeviceArray")
        host = host_array(host_view(array, "array")[0], "array")
        if host.shape != self._shape or host.dtype != self._dtype:
            raise InvalidArgument(
                "array", f"must have shape {self._shape} and dtype {self._dtype}, got {host.shape} {host.dtype}"
            )
        if stream is None:
            stream = active_stream(alloc.device)
        state = resolve_stream(stream, alloc.device) if stream is not None else None
        _copy_in(alloc, self.address, host, state, self.whole)

    def close(self) -> None:
        """Drop this array's hold on the memory; it is freed once no array views it and no
        queued work uses it. Safe twice."""
        self.alloc = None
        _lifetime.collect()


def _is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    if not all(shape):
        return True  # no elements: nothing is laid out
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def may_overlap(a: DeviceArray, b: DeviceArray) -> bool:
    """Whether two views share a byte of device memory (exact, strides included)."""
    (alo, ahi), (blo, bhi) = a.span, b.span
    if ahi < alo or bhi < blo or ahi < blo or bhi < alo:
        return False
    if a.is_contiguous and b.is_contiguous:
        return True
    # Strided views whose ranges meet may still interleave without touching: ask NumPy's exact
    # solver, on arrays that only describe the addresses (nothing is read).
    return bool(np.shares_memory(_address_view(a), _address_view(b)))


class _AddressOnly:
    """An __array_interface__ describing a view by address, never dereferenced."""

    def __init__(self, a: DeviceArray) -> None:
        self.__array_interface__ = {
            "data": (a.address, True),
            "shape": a.shape,
            "strides": a.strides,
            "typestr": f"|V{a.itemsize}",
            "version": 3,
        }


def _address_view(a: DeviceArray) -> np.ndarray:
    return np.asarray(_AddressOnly(a))


def host_array(array: np.ndarray, name: str) -> np.ndarray:
    """A C-contiguous, native-byte-order copy (or the array itself when it already is one)."""
    if array.dtype == object:
        raise InvalidArgument(name, "dtype object cannot go to the device")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    acl_data_type(array.dtype)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # (which makes 0-D 1-D)


def _order_after(alloc: Allocation, state: StreamState | None, writers_only: bool = False) -> None:
    """Order host access to ``alloc`` after work queued on other streams that uses it (that
    writes it, for a read): on ``state`` through events; without a stream, by waiting. A
    stream-less write's wait is a synchronize of those streams (it raises a fault no
    synchronize raised yet); a read's wait only records one (the read raises the fault of its
    memory's latest write, if any: check_written). A stream destroyed meanwhile has run
    everything and needs nothing; one another thread is closing is waited for on the host (it
    takes no new work, and its close's own wait may not have run the work yet)."""
    track = alloc.track
    for other in track.writers if writers_only else track.users:  # a tuple, replaced whole
        if other is state:
            continue  # stream order
        if other.closed or other.device.closed:
            track.forget(other)
            continue
        if state is not None and not other.closing:
            try:
                ev = Event(other.device)
                core = ev.core()
                other.enqueue(core, acl.record_event, core.handle)
                state.enqueue(core, acl.stream_wait_event, core.handle)
                continue
            except ClosedError:
                if state.closing or state.device.closed:
                    raise  # the caller's own stream
        # A synchronize even when the stream looks idle: it is what reports a device fault of
        # the work that used the memory (a query does not). In place of an event (a stream
        # being closed), it reports as the event would: nothing.
        if not other.wait_unless_destroyed(report=state is None and not writers_only):
            track.forget(other)


def _copy_in(alloc: Allocation, dst: int, host: np.ndarray, state: StreamState | None, whole: bool) -> None:
    n = host.nbytes
    if n == 0:
        return
    _order_after(alloc, state)
    if state is not None:
        if not is_pinned(host):
            # A snapshot now, in pinned memory: later writes to the caller's array cannot
            # change what is copied, and CANN copies from pinned memory asynchronously (from
            # pageable memory aclrtMemcpyAsync returns only once the copy is done).
            stage = pinned_block(alloc.device, n)
            # (through Device.call: the device's close frees its pinned blocks, after this)
            alloc.device.call(np.copyto, stage[:n], host.reshape(-1).view(np.uint8))
            host = stage
        alloc.used_on(state, write=True)
        state.enqueue((host, alloc), acl.memcpy_async, dst, n, host.ctypes.data, n, "ACL_MEMCPY_HOST_TO_DEVICE",
                      writes=((alloc.track, whole),))
    else:
        alloc.device.call(acl.memcpy, dst, n, host.ctypes.data, n, "ACL_MEMCPY_HOST_TO_DEVICE")
        if whole:  # written now, by the host: whatever faulted before is gone (a part: the rest stays)
            alloc.track.written = ()


def empty(shape: Any, dtype: Any, device: Device | int | None = None) -> DeviceArray:
    """A new contiguous DeviceArray with uninitialized contents."""
    shp = _args.shape("shape", shape)
    dt = _dtype(dtype)
    _args.nbytes("shape", shp, dt.itemsize)
    return new_empty(shp, dt, resolve_device(device))


def new_empty(shape: tuple[int, ...], dtype: np.dtype, device: Device, state: StreamState | None = None
              ) -> DeviceArray:
    """:func:`empty` of a shape, dtype and device already checked (the op layer's outputs),
    for use on stream ``state`` first (see :func:`~.allocator.allocate`)."""
    return empty_from(contiguous_layout(shape, dtype), device, state)


def contiguous_layout(shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, ...]:
    """Everything a contiguous DeviceArray of ``shape`` and ``dtype`` (both checked) is made
    of but its memory, for :func:`empty_from`: a caller making many keeps it."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    strides = _contiguous_strides(shape)
    layout = (shape, dtype, strides)
    return (layout, n, _layout_id(layout), acl_data_type(dtype))


def empty_from(made: tuple[Any, ...], device: Device, state: StreamState | None = None) -> DeviceArray:
    """A new contiguous DeviceArray of a :func:`contiguous_layout` (the one call's outputs:
    nothing is computed again)."""
    (shape, dtype, strides), n, layout_id, code = made
    return DeviceArray(allocate(device, n, state), shape, dtype, strides, 0, (layout_id, code, n))


def _dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument("dtype", f"{dtype!r} is not a numpy dtype") from None
    acl_data_type(dt)
    return dt  # type: ignore[no-any-return]  # np.dtype() of Any is typed Any


def zeros(shape: Any, dtype: Any, device: Device | int | None = None, stream: Stream | None = None) -> DeviceArray:
    """A new contiguous DeviceArray of zeros (memset on ``stream``, or the thread's current
    stream inside ``with stream:``; else now)."""
    if stream is not None:
        _args.instance("stream", stream, Stream, "a Stream or None")
    arr = empty(shape, dtype, device if device is not None or stream is None else stream.device)
    alloc = arr.allocation()
    if stream is None:
        stream = active_stream(alloc.device)
    n = alloc.nbytes
    if n:
        if stream is not None:
            state = resolve_stream(stream, alloc.device)
            alloc.used_on(state, write=True)
            state.enqueue(alloc, acl.memset_async, alloc.ptr, n, 0, n, writes=((alloc.track, True),))
        else:
            alloc.device.call(acl.memset, alloc.ptr, n, 0, n)
    return arr


def to_device(array: Any, stream: Stream | None = None, device: Device | int | None = None) -> DeviceArray:
    """Copy a NumPy array (or anything np.asarray takes) to a new contiguous DeviceArray.

    Fortran-ordered, strided or byte-swapped input is first made C-contiguous and native on
    the host. With ``stream`` (or inside ``with stream:``) the copy is queued on it (the host
    data is held until the copy has run); without, it is done before returning.
    """
    host = host_array(host_view(array, "array")[0], "array")
    if stream is not None:
        _args.instance("stream", stream, Stream, "a Stream or None")
        dev = stream.device if device is None else resolve_device(device)
        state: StreamState | None = resolve_stream(stream, dev)
    else:
        dev = resolve_device(device)
        cur = active_stream(dev)
        state = resolve_stream(cur, dev) if cur is not None else None
    return copy_in_native(host, dev, state)


def copy_in_native(host: np.ndarray, device: Device, state: StreamState | None) -> DeviceArray:
    """:func:`to_device` of an array already native and C-contiguous (:func:`host_array`'s),
    on the stream ``state`` (None: now)."""
    alloc = allocate(device, host.nbytes)
    arr = DeviceArray(alloc, host.shape, host.dtype, _contiguous_strides(host.shape), 0)
    _copy_in(alloc, alloc.ptr, host, state, True)
    return arr


def from_pointer(ptr: int, shape: Sequence[int], dtype: Any, strides: Sequence[int] | None = None, offset: int = 0,
                 owner: Any = None, device: Device | int | None = None) -> DeviceArray:
    """Wrap device memory allocated elsewhere (a torch_npu tensor's ``data_ptr()``, say).

    ``ptr`` is the storage base. ``strides`` are in bytes, as :attr:`DeviceArray.strides`,
    NumPy and CuPy have them (each a multiple of the item size; default: row-major); ``offset``
    is in elements from ``ptr``, as :attr:`DeviceArray.offset` and torch's ``storage_offset()``.
    The memory is borrowed: it is never freed here, and ``owner`` is kept alive as long as any
    array viewing it (or queued work using it), so the memory cannot go away underneath.
    """
    p = _args.integer("ptr", ptr, 1, 2**64 - 1)
    dt = _dtype(dtype)
    shp = _args.shape("shape", shape)
    if strides is None:
        st = _contiguous_strides(shp)
    else:
        byte_strides = _args.shape("strides", strides)
        if len(byte_strides) != len(shp):
            raise InvalidArgument("strides", f"must have {len(shp)} entries, one per dimension, got "
                                             f"{len(byte_strides)}")
        if any(b % dt.itemsize for b in byte_strides):
            # A silent floor division would make a view of other elements than the caller's.
            raise InvalidArgument("strides", f"are in bytes and must be multiples of the item size "
                                             f"({dt.itemsize} for {dt}), got {byte_strides}")
        st = tuple(b // dt.itemsize for b in byte_strides)
    off = _args.int64("offset", offset, lo=0)
    dev = resolve_device(device)
    extent = off + (sum((n - 1) * s for n, s in zip(shp, st)) + 1 if all(shp) else 0)
    nbytes = extent * dt.itemsize
    if p + nbytes > 2**64:
        raise InvalidArgument("ptr", f"{p:#x} + {nbytes} bytes runs past the end of the address space")
    return DeviceArray(borrowed(dev, p, nbytes, owner), shp, dt, st, off)



# torch's dtype names -> NumPy dtypes (torch itself is never imported here).
_TORCH_DTYPES = {
    "torch.float16": np.dtype(np.float16), "torch.bfloat16": np.dtype(bfloat16), "torch.float32": np.dtype(np.float32),
    "torch.float64": np.dtype(np.float64), "torch.int8": np.dtype(np.int8), "torch.uint8": np.dtype(np.uint8),
    "torch.int16": np.dtype(np.int16), "torch.int32": np.dtype(np.int32), "torch.int64": np.dtype(np.int64),
    "torch.bool": np.dtype(np.bool_), "torch.complex64": np.dtype(np.complex64),
    "torch.complex128": np.dtype(np.complex128),
}


def from_torch(tensor: Any) -> DeviceArray:
    """A DeviceArray viewing a torch_npu tensor's device memory: no copy, same shape, strides,
    storage offset and dtype, on the tensor's device. The tensor is kept alive as long as the
    view or queued work uses the memory. Host (CPU) tensors need no wrapping: pass them to
    the one-call function or to :func:`to_device` directly.

    Run on the tensor's stream, or order the streams: ``pm.Stream.from_handle(
    torch_npu.npu.current_stream().npu_stream)`` queues pyacl_moe's work where torch's is.
    """
    if type(tensor).__module__.partition(".")[0] != "torch" or not hasattr(tensor, "untyped_storage"):
        raise InvalidArgument("tensor", f"must be a torch tensor, got {type(tensor).__name__}")
    where = tensor.device
    if where.type != "npu":
        raise InvalidArgument("tensor", f"is on {where}, not an NPU: from_torch wraps torch_npu tensors; pass "
                                        "host tensors to moe_init_routing_v2_grad or to_device directly")
    dt = _TORCH_DTYPES.get(str(tensor.dtype))
    if dt is None:
        raise InvalidArgument("tensor", f"has dtype {tensor.dtype}, which CANN's tensors here do not take")
    base = int(tensor.untyped_storage().data_ptr())
    return from_pointer(base, tuple(int(n) for n in tensor.shape), dt,
                        tuple(int(s) * dt.itemsize for s in tensor.stride()),  # torch's are in elements
                        int(tensor.storage_offset()), owner=tensor,
                        device=where.index if where.index is not None else None)
