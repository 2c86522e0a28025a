"""Device memory: :class:`DeviceArray` and the copies between host and device.

A DeviceArray is a typed, strided view (element strides and offset, as aclCreateTensor takes
them) of an :class:`~pyacl_moe.device.Allocation`, which it owns or borrows
(``DeviceArray.from_pointer``). Basic slicing gives views that share the allocation. The memory
goes back once no array views it and no queued work uses it, or when its device closes.

Every copy runs on a stream. With ``stream`` (or inside ``with stream:``) it is queued there,
after the memory's last writer when that is another stream (a read waits for it on the host;
ordering anything else between streams is the caller's, through events) and the host buffer is
held until it has run; without, it runs on the default stream once the memory's last writer
has run (waited for on the host), and is waited for. A fresh array's writer is the stream it
was made for. Memory whose writer the binding cannot know (borrowed) waits for the whole
device.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import types
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import _args
from ._cann import acl, declare
from .device import Allocation, Device, collect, is_pinned, pinned_block, resolve_device
from .errors import ClosedError, InvalidArgument
from .host import host_view
from .stream import Stream, StreamState, resolve_stream, thread_current

__all__ = ["DeviceArray", "acl_data_type", "bfloat16", "contiguous_layout", "empty", "empty_from", "from_pointer",
           "from_torch", "host_array", "may_overlap", "to_device", "wait_for", "zeros"]

#: ml_dtypes' bfloat16 scalar type (``pm.bfloat16(1.5)``, ``x.astype(pm.bfloat16)``).
bfloat16 = ml_dtypes.bfloat16

# numpy dtype -> the aclDataType it is (values read from headers/): ACL_ and NumPy's name in
# capitals, but for the three CANN spells its own way.
_ACL_RENAMED = {"float32": "FLOAT", "float64": "DOUBLE", "bfloat16": "BF16"}
_ACL_NAMES: dict[np.dtype, str] = {np.dtype(name): "ACL_" + _ACL_RENAMED.get(name, name.upper()) for name in (
    "float32", "float16", "int8", "int32", "uint8", "int16", "uint16", "uint32", "int64", "uint64", "float64", "bool",
    "complex64", "complex128", "bfloat16")}  # (bfloat16: ml_dtypes', imported above)


def acl_data_type(dtype: Any) -> int:
    """The aclDataType code of a numpy dtype; InvalidArgument if CANN has none."""
    dt = _args.dtype("dtype", dtype)
    name = _ACL_NAMES.get(dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt)
    if name is None:
        supported = ", ".join(sorted(str(d) for d in _ACL_NAMES))
        raise InvalidArgument("dtype", f"{dt} has no CANN data type (supported: {supported})")
    return declare.const(name)


def _extent(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a view's first to just past its last (0 when it has none)."""
    return sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else 0


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
    global _layout_ids
    if (got := _layout_ids.get(layout)) is not None:
        return got
    with _layout_lock:
        if layout not in _layout_ids:  # (another thread may have added it meanwhile)
            _layout_ids = {**(_layout_ids if len(_layout_ids) < _LAYOUTS_MAX else {}), layout: next(_layout_counter)}
        return _layout_ids[layout]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):  # (an axis of no elements strides as one of one)
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


class DeviceArray:
    """An n-dimensional array in device memory.

    ``shape``, ``dtype`` and ``strides`` (in bytes) as in NumPy and CuPy; ``element_strides``
    and ``offset`` are in elements, as aclCreateTensor takes them. Create one with
    :func:`to_device`, :func:`empty`, :func:`zeros` or :func:`from_pointer`; read it back with
    :meth:`to_host`. NumPy never converts one implicitly: the copy and its wait are explicit.
    ``close()`` (or ``with``) drops this array's hold on the memory.
    """

    __slots__ = ("alloc", "_layout", "_offset", "span", "layout_id", "__weakref__")

    def __init__(self, alloc: Allocation, shape: tuple[int, ...], dtype: np.dtype, strides: tuple[int, ...],
                 offset: int) -> None:
        #: the Allocation the view is of (None once closed); :meth:`allocation` checks it
        self.alloc: Allocation | None = alloc
        self._offset = offset
        self._layout = (shape, dtype, strides)  # (element strides; every caller checked the dtype)
        lo = alloc.ptr + offset * dtype.itemsize
        #: (first, last) device byte addresses the view touches (last < first when empty)
        self.span = (lo, lo + _extent(shape, strides) * dtype.itemsize - 1)
        #: a small int naming :attr:`layout` in this process: a cheap key for caches
        self.layout_id = _layout_id(self._layout)

    # -- for pyacl_moe's own layers

    def allocation(self, what: str = "array") -> Allocation:
        """The allocation this array views, checked alive (ClosedError otherwise)."""
        a = self.alloc
        if a is None:
            raise ClosedError(what, "this DeviceArray was closed")
        a.check_open(what)
        return a

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
        return self._layout[0]

    @property
    def dtype(self) -> np.dtype:
        """The element type, as in NumPy (bfloat16 is ml_dtypes.bfloat16)."""
        return self._layout[1]

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in bytes, as NumPy and CuPy have them."""
        return tuple(s * self._layout[1].itemsize for s in self._layout[2])

    @property
    def element_strides(self) -> tuple[int, ...]:
        """Strides in elements: what the aclTensor of the view gets (aclCreateTensor's unit)."""
        return self._layout[2]

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
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (not of the storage)."""
        return self.size * self.itemsize

    @property
    def acl_data_type(self) -> int:
        """The aclDataType code of the dtype."""
        return acl_data_type(self.dtype)

    @property
    def data_ptr(self) -> int:
        """The storage base address (what aclCreateTensor receives as tensorData)."""
        return self.allocation().ptr

    @property
    def address(self) -> int:
        """The device address of the first element."""
        return self.allocation().ptr + self._offset * self.dtype.itemsize

    @property
    def storage_size(self) -> int:
        """Elements in the underlying storage."""
        return self.allocation().nbytes // self.dtype.itemsize

    @property
    def owns_memory(self) -> bool:
        """False for memory borrowed through from_pointer."""
        return self.allocation().owner is None

    @property
    def is_contiguous(self) -> bool:
        """True when the view is C-contiguous."""
        shape, _, strides = self._layout
        # (no elements: nothing is laid out; an axis of one has no stride that matters)
        return not all(shape) or all(n == 1 or s == c for n, s, c in zip(shape, strides, _contiguous_strides(shape)))

    @property
    def closed(self) -> bool:
        """True once closed, or once its device was closed."""
        a = self.alloc
        return a is None or not a.context.open

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        if self.closed:
            return f"<DeviceArray closed shape={self.shape} dtype={self.dtype}>"
        return (f"<DeviceArray shape={self.shape} dtype={self.dtype} element_strides={self._layout[2]} "
                f"offset={self._offset} device={self.device.device_id} address={self.address:#x}>")

    # -- views

    def __getitem__(self, key: Any) -> DeviceArray:
        """Basic slicing (ints, slices with positive steps, Ellipsis), as NumPy has it: a view,
        no copy. Fancy (integer-array) and boolean indexing are refused: they copy, which a view
        cannot."""
        alloc, keys = self.allocation(), key if isinstance(key, tuple) else (key,)
        for k in keys:
            if k is None:
                raise InvalidArgument("key", "None (np.newaxis) is not supported: use reshape() to add an axis")
            if isinstance(k, slice) and k.step is not None and k.step < 0:
                raise InvalidArgument("key", "negative slice steps are not supported: CANN views take non-negative "
                                             "strides")
            if isinstance(k, list) or hasattr(k, "__array__") and not isinstance(k, np.generic):  # (DeviceArray too)
                raise InvalidArgument("key", "fancy (integer-array) and boolean indexing are not supported on a "
                                             "DeviceArray: they copy, and DeviceArray indexing gives views; index the "
                                             "host copy (to_host()[key]) instead")
            if not (k is Ellipsis or isinstance(k, (slice, int, np.integer))) or isinstance(k, (bool, np.bool_)):
                raise InvalidArgument("key", f"only ints, slices and '...' index a DeviceArray, got {type(k).__name__}")
        # NumPy's own basic indexing, on an array that only describes the view (nothing is
        # read), of one-byte items so that its strides and offsets are in elements; a leading
        # axis of one keeps every result an array, never a scalar.
        whole = np.lib.stride_tricks.as_strided(np.empty(1, "V1"), (1, *self.shape), (1, *self._layout[2]))
        view = whole[(slice(None), *keys)]
        moved = view.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
        return DeviceArray(alloc, view.shape[1:], self.dtype, view.strides[1:], self._offset + moved)

    # -- copies

    def to_host(self, stream: Stream | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """Copy to a NumPy array: a new one, or ``out``.

        With ``stream`` (or inside ``with stream:``) the copy is queued there, after the
        memory's last writer (waited for on the host when it is another stream), and waited
        for; without, it runs on the default stream once the memory's last writer has run,
        and is waited for.

        With ``out`` (a writable C-contiguous NumPy array of this shape and dtype) and a stream,
        the copy is queued into ``out`` and not waited for: ``out`` is complete once the stream
        has run it (``stream.synchronize()``, an event). From pinned memory
        (:func:`pinned_empty`) CANN copies asynchronously; into pageable memory
        aclrtMemcpyAsync returns once the copy is done.
        """
        alloc, dense = self.allocation(), self.is_contiguous
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise InvalidArgument("out", f"must be a NumPy array, got {type(out).__name__}")
            self._check_like("out", out)
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise InvalidArgument("out", "must be C-contiguous and writable")
            if not dense:
                raise InvalidArgument("array", "to_host(out=...) needs a contiguous DeviceArray (copy() it first)")
        lo, hi = self.span
        n = hi - lo + 1  # (0 when empty: an empty view is contiguous, a strided one has elements)
        # A strided view is read as its bytes from the first to the last, its elements picked out on the host.
        host = np.empty(n, np.uint8) if not dense else np.empty(self.shape, self.dtype) if out is None else out
        if n:
            _queued(alloc, stream, host, (host.ctypes.data, n, lo, n, "ACL_MEMCPY_DEVICE_TO_HOST"), wait=out is None)
        return host if dense else np.lib.stride_tricks.as_strided(host.view(self.dtype), self.shape,
                                                                  self.strides).copy()

    def _check_like(self, name: str, host: np.ndarray) -> None:
        if host.shape != self.shape or host.dtype != self.dtype:
            raise InvalidArgument(name, f"must have shape {self.shape} and dtype {self.dtype}, got "
                                        f"{host.shape} {host.dtype}")

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
        try:  # NumPy's rules, on an array of zero strides that holds nothing
            shp = np.broadcast_to(np.uint8(0), self.shape).reshape(*shape).shape
        except (TypeError, ValueError) as exc:
            raise InvalidArgument("shape", f"must hold the array's {self.size} elements, with at most one -1 "
                                           f"entry, got {shape} ({exc})") from None
        base = self if self.is_contiguous else self.copy()
        return DeviceArray(base.allocation(), shp, self.dtype, _contiguous_strides(shp), base._offset)

    def copy(self, stream: Stream | None = None) -> DeviceArray:
        """A new contiguous DeviceArray with the same values. A contiguous array is copied on
        the device (on ``stream``, or the current stream inside ``with stream:``; else on its
        writer stream, waited for); a strided one goes through the host, since CANN's runtime
        copies only dense bytes."""
        alloc = self.allocation()
        if not self.is_contiguous:
            return to_device(self.to_host(stream), stream=stream, device=alloc.device)
        out = empty(self.shape, self.dtype, alloc.device, stream)
        n, dst = self.nbytes, out.allocation()
        if n:
            _queued(alloc, stream, dst, (dst.ptr, n, self.address, n, "ACL_MEMCPY_DEVICE_TO_DEVICE"), dst)
        return out

    def fill(self, value: Any, stream: Stream | None = None) -> None:
        """Set every element to ``value`` (converted to the dtype as NumPy converts it). Zero is
        a memset on the device; other values are copied from the host. Needs a contiguous
        array: a strided view shares its gaps with other views."""
        if not self.is_contiguous:
            raise InvalidArgument("array", "fill() needs a contiguous DeviceArray")
        try:
            v = np.asarray(value).astype(self.dtype, casting="unsafe")
        except (TypeError, ValueError):
            raise InvalidArgument("value", f"must convert to {self.dtype}, got {value!r}") from None
        if v.ndim:
            raise InvalidArgument("value", f"must be a scalar, got shape {v.shape}")
        alloc, n = self.allocation(), self.nbytes
        if v.tobytes().strip(b"\0"):  # not all-zero bits (-0.0 is not): copied from the host (nothing when empty)
            self.copy_from_host(np.full(self.shape, v, self.dtype), stream)
        elif n:
            _queued(alloc, stream, None, (self.address, n, 0, n), alloc, fn=acl.memset_async)

    def copy_from_host(self, array: Any, stream: Stream | None = None) -> None:
        """Overwrite this (contiguous) array with ``array``'s values.

        With ``stream`` (or inside ``with stream:``) the copy is queued there (a snapshot of
        ``array`` is taken now); without, it runs on the default stream once the memory's last
        writer has run, and is waited for.
        """
        alloc = self.allocation()
        if not self.is_contiguous:
            raise InvalidArgument("array", "copy_from_host needs a contiguous DeviceArray")
        host = host_array(host_view(array, "array")[0], "array")
        self._check_like("array", host)
        n = host.nbytes
        if not n:
            return
        fn = acl.memcpy_async
        if _given(stream, alloc.device) is not None and not is_pinned(host):
            # Queued, not waited for: a snapshot in pinned memory now, so that later writes to the
            # caller's array cannot change what is copied (and CANN copies pinned memory
            # asynchronously). It is filled under the stream's lock, once the stream is known
            # open: a teardown (close, reset), which frees every pinned block, shuts the stream
            # under that lock first, so the fill never writes freed memory.
            stage, src = pinned_block(alloc.device, n), host.reshape(-1).view(np.uint8)
            fn = functools.partial(_staged, stage[:n], src)
            host = stage
        _queued(alloc, stream, host, (self.address, n, host.ctypes.data, n, "ACL_MEMCPY_HOST_TO_DEVICE"), alloc, fn=fn)

    def close(self) -> None:
        """Drop this array's hold on the memory; it goes back once no array views it and no
        queued work uses it. Safe twice."""
        self.alloc = None
        collect()

    def __enter__(self) -> DeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _given(stream: Stream | None, device: Device) -> StreamState | None:
    """The stream a copy was given (or the thread's current one inside ``with stream:``),
    checked; None when there is none."""
    if stream is None:
        cur = thread_current.stream
        return cur.state if cur is not None and cur.state.device is device else None
    return resolve_stream(stream, device)


def wait_for(state: StreamState) -> None:
    """Wait for ``state`` and what it was ordered after through events (a device-wide wait
    then); raises the device's fault if any wait learned of one."""
    collect()
    state.synchronize(closing=True)  # (a stream another thread is closing still runs what it took)
    if state.after_events:
        state.device.wait_all(f"a read on {state!r}")
    state.device.check()


def _queued(alloc: Allocation, stream: Stream | None, hold: Any, args: tuple[Any, ...], writes: Any = None,
            wait: bool = False, fn: Any = acl.memcpy_async) -> None:
    """Queue ``fn(*args)`` (a copy) of ``alloc``, which writes ``writes`` (None: a host read), on
    the stream given (or the thread's current one inside ``with stream:``, :func:`_given`),
    holding ``alloc`` and ``hold`` until it has run; without one, on the default stream, waited
    for (and so with ``wait``).

    A host access (a read, or a copy waited for) first waits on the host for the memory's last
    writer when that is another stream (even while another thread closes it: its close may not
    have run the write yet; a read on an event-ordered stream would never learn of its fault),
    and for the whole device when the writer cannot be known (borrowed memory) or was ordered
    after other streams through events."""
    dev, w = alloc.device, alloc.writer
    given = _given(stream, dev)
    on = given if given is not None else dev.default_stream.state
    if (writes is None or given is None) and w is not on and (w is not None or alloc.owner is not None):
        dev.check()
        if w is not None:
            w.synchronize(closing=True)
        if w is None or w.after_events:  # (borrowed: whoever wrote it, a device-wide wait covers it)
            dev.wait_all("a host access of borrowed memory" if w is None else f"a read of what {w!r} wrote")
    on.enqueue((hold, alloc), [(fn, args)], (writes,))
    if wait or given is None:
        wait_for(on)


def _staged(stage: np.ndarray, src: np.ndarray, *args: Any) -> None:
    # (the stream's lock held, the stream open) The snapshot, then its copy.
    np.copyto(stage, src)
    acl.memcpy_async(*args)


def may_overlap(a: DeviceArray, b: DeviceArray) -> bool:
    """Whether two views share a byte of device memory (exact, strides included)."""
    (alo, ahi), (blo, bhi) = a.span, b.span
    # Byte ranges that meet (an empty one, last < first, meets none): strided views may still
    # interleave without touching, so ask NumPy's exact solver, on arrays that only describe
    # the addresses (nothing is read).
    return max(alo, blo) <= min(ahi, bhi) and (a.is_contiguous and b.is_contiguous or bool(
        np.shares_memory(_address_view(a), _address_view(b))))


def _address_view(a: DeviceArray) -> np.ndarray:
    # (an __array_interface__ describing the view by address, never dereferenced)
    return np.asarray(types.SimpleNamespace(__array_interface__={
        "data": (a.address, True), "shape": a.shape, "strides": a.strides, "typestr": f"|V{a.itemsize}", "version": 3}))


def host_array(array: np.ndarray, name: str) -> np.ndarray:
    """A C-contiguous, native-byte-order copy (or the array itself when it already is one)."""
    if array.dtype == object:
        raise InvalidArgument(name, "dtype object cannot go to the device")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    acl_data_type(array.dtype)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)  # (which makes 0-D 1-D)


def _dtype(dtype: Any) -> np.dtype:
    dt = _args.dtype("dtype", dtype)
    acl_data_type(dt)
    return dt


def contiguous_layout(shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, ...]:
    """Everything a contiguous DeviceArray of ``shape`` and ``dtype`` (both checked: a dtype CANN
    has a type for) is made of but its memory, for :func:`empty_from`: a caller making many
    keeps it."""
    layout = (shape, dtype, _contiguous_strides(shape))
    return layout, math.prod(shape, start=dtype.itemsize), _layout_id(layout)


def empty_from(made: Sequence[tuple[Any, ...]], sizes: Sequence[int], device: Device,
               home: StreamState | None) -> list[DeviceArray]:
    """New contiguous DeviceArrays of :func:`contiguous_layout` s (one call's outputs: nothing is
    computed again) and their ``sizes`` in bytes (kept by the caller too), their memory taken
    at once for work on stream ``home``."""
    out, new = [], object.__new__
    for a, m in zip(device.allocate(sizes, home), made):
        # (DeviceArray.__init__ inline, nothing looked up again: a one call makes three)
        d = new(DeviceArray)
        d.alloc, d._offset, d._layout, d.layout_id = a, 0, m[0], m[2]
        d.span = (a.ptr, a.ptr + m[1] - 1)
        out.append(d)
    return out


def empty(shape: Any, dtype: Any = np.float32, device: Device | int | None = None,
          stream: Stream | None = None) -> DeviceArray:
    """A new contiguous DeviceArray with uninitialized contents, for work on ``stream`` (default:
    the thread's current stream): memory that stream let go of may be taken at once."""
    if stream is not None:  # (before its device is asked for)
        _args.instance("stream", stream, Stream, "a Stream or None")
    shp = _args.shape("shape", shape)
    dt = _dtype(dtype)
    _args.nbytes("shape", shp, dt.itemsize)
    dev = resolve_device(device) if device is not None or stream is None else stream.device
    collect()
    m = contiguous_layout(shp, dt)
    return empty_from((m,), (m[1],), dev, _given(stream, dev) or dev.default_stream.state)[0]


def zeros(shape: Any, dtype: Any = np.float32, device: Device | int | None = None,
          stream: Stream | None = None) -> DeviceArray:
    """A new contiguous DeviceArray of zeros (memset on ``stream``, or the thread's current
    stream inside ``with stream:``; else waited for)."""
    arr = empty(shape, dtype, device, stream)
    arr.fill(0, stream)
    return arr


def to_device(array: Any, stream: Stream | None = None, device: Device | int | None = None) -> DeviceArray:
    """Copy a NumPy array (or anything np.asarray takes) to a new contiguous DeviceArray.

    Fortran-ordered, strided or byte-swapped input is first made C-contiguous and native on
    the host. With ``stream`` (or inside ``with stream:``) the copy is queued on it (a snapshot
    of the host data is taken now); without, it is done before returning.
    """
    host = host_array(host_view(array, "array")[0], "array")
    out = empty(host.shape, host.dtype, device, stream)
    out.copy_from_host(host, stream)
    return out


def from_pointer(ptr: int, shape: Sequence[int], dtype: Any, strides: Sequence[int] | None = None, offset: int = 0,
                 owner: Any = None, device: Device | int | None = None) -> DeviceArray:
    """Wrap device memory allocated elsewhere (a torch_npu tensor's ``data_ptr()``, say).

    ``ptr`` is the storage base. ``strides`` are in bytes, as :attr:`DeviceArray.strides`,
    NumPy and CuPy have them (each a multiple of the item size; default: row-major); ``offset``
    is in elements from ``ptr``, as :attr:`DeviceArray.offset` and torch's ``storage_offset()``.
    The memory is borrowed: it is never freed here, and ``owner`` is kept alive as long as any
    array viewing it (or queued work using it), so the memory cannot go away underneath. The
    binding cannot know what wrote borrowed memory: a read without a write of its own through
    this wrapper waits for the whole device.
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
    nbytes = (off + _extent(shp, st)) * dt.itemsize
    if p + nbytes > 2**64:
        raise InvalidArgument("ptr", f"{p:#x} + {nbytes} bytes runs past the end of the address space")
    return DeviceArray(Allocation(dev, nbytes, p, owner if owner is not None else _NO_OWNER), shp, dt, st, off)


_NO_OWNER = object()  # what a borrowed allocation without an owner keeps (it marks the memory borrowed)

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
    try:  # torch's dtype names are NumPy's (bfloat16: ml_dtypes')
        dt = _dtype(str(tensor.dtype).rpartition(".")[2])
    except (InvalidArgument, TypeError):
        raise InvalidArgument("tensor", f"has dtype {tensor.dtype}, which CANN's tensors here do not take") from None
    return from_pointer(int(tensor.untyped_storage().data_ptr()), tuple(int(n) for n in tensor.shape), dt,
                        tuple(int(s) * dt.itemsize for s in tensor.stride()),  # torch's are in elements
                        int(tensor.storage_offset()), owner=tensor, device=where.index)
