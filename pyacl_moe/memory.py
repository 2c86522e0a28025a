"""Device memory: :class:`DeviceArray` and the copies between host and device.

A DeviceArray is a typed, strided view (element strides and offset, as aclCreateTensor takes
them) of a device allocation, which it owns (aclrtMalloc/aclrtFree) or borrows
(``DeviceArray.from_pointer``). Basic slicing gives views that share the memory. The memory is
freed when the last array viewing it is closed or collected, or when its device is closed.

Copies to the device and back follow stream order: a copy on a stream keeps its host buffer
alive until that stream is synchronized, and reading an array back defaults to the stream that
last wrote it, so results are never stale.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import _ffi
from .errors import InvalidArgument
from .runtime import Device, Stream, _resolve_device, _Resource

__all__ = ["DeviceArray", "acl_data_type", "empty", "memory_stats", "to_device", "zeros"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

# numpy dtype -> aclDataType (values from acl_base.h).
_ACL_DTYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): 0,
    np.dtype(np.float16): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int32): 3,
    np.dtype(np.uint8): 4,
    np.dtype(np.int16): 6,
    np.dtype(np.uint16): 7,
    np.dtype(np.uint32): 8,
    np.dtype(np.int64): 9,
    np.dtype(np.uint64): 10,
    np.dtype(np.float64): 11,
    np.dtype(np.bool_): 12,
    np.dtype(np.complex64): 16,
    np.dtype(np.complex128): 17,
    bfloat16: 27,
}


def acl_data_type(dtype: Any) -> int:
    """The aclDataType code of a numpy dtype; InvalidArgument if CANN has none."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument("dtype", f"{dtype!r} is not a numpy dtype") from None
    code = _ACL_DTYPES.get(dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt)
    if code is None:
        supported = ", ".join(sorted(str(d) for d in _ACL_DTYPES))
        raise InvalidArgument("dtype", f"{dt} has no CANN data type (supported: {supported})")
    return code


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _free_allocation(device: Device, generation: int, ptr: int, live: list[bool]) -> None:
    """Finalizer of an owned allocation: free it unless its device already did."""
    # Said first: the collector may run this for an object caught in a cycle and then let
    # another finalizer of that cycle resurrect it (a plan handing its workspace back to the
    # pool, say); the resurrected object must then read as freed.
    live[0] = False
    if device._alive(generation):
        try:
            device._activate()
            _ffi.free(ptr)
        except Exception:
            pass  # nothing can be raised from a finalizer


class _Allocation(_Resource):
    """One device allocation, shared by every DeviceArray that views it."""

    _release_rank = 2

    def __init__(self, device: Device, ptr: int, nbytes: int, owned: bool, owner: Any = None) -> None:
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self.owned = owned
        self.owner = owner  # what keeps borrowed memory alive
        self.generation = device._generation
        self.last_stream: Stream | None = None  # the stream of the last queued write
        # Cleared when the memory is released: by its device's close, by the pool, or by the
        # finalizer (a cell shared with it, since the finalizer cannot hold the object).
        self._live = [True]
        self._finalizer = (
            weakref.finalize(self, _free_allocation, device, self.generation, ptr, self._live) if owned else None
        )
        device._register(self)

    @property
    def alive(self) -> bool:
        return self._live[0]

    def _release(self) -> None:
        """Free now (Device.close calls this before aclrtResetDevice)."""
        self._live[0] = False
        self.device._unregister(self)
        fin = self._finalizer
        if fin is not None and fin.detach() is not None and self.device._alive(self.generation):
            self.device._activate()
            _ffi.free(self.ptr)
        self.owner = None


class DeviceArray:
    """An n-dimensional array in device memory.

    ``shape`` and ``dtype`` as in NumPy; ``strides`` and ``offset`` are in elements, as
    aclCreateTensor takes them. Create one with :func:`to_device`, :func:`empty`,
    :func:`zeros` or :meth:`from_pointer`; read it back with :meth:`to_host` / :meth:`numpy`.
    """

    __slots__ = ("_alloc", "_shape", "_dtype", "_strides", "_offset", "_acl_dtype", "_desc", "__weakref__")

    def __init__(self, alloc: _Allocation, shape: tuple[int, ...], dtype: np.dtype,
                 strides: tuple[int, ...], offset: int) -> None:
        self._alloc: _Allocation | None = alloc
        self._shape = shape
        self._dtype = dtype
        self._strides = strides
        self._offset = offset
        self._acl_dtype = acl_data_type(dtype)
        self._desc: Any = None  # the aclTensor description, built on first use

    def _tensor_desc(self) -> Any:
        """What aclCreateTensor needs for this array, built once (an opaque object of _ffi)."""
        d = self._desc
        if d is None:
            a = self._live_alloc()
            d = self._desc = _ffi.tensor_desc(
                self._shape, self._acl_dtype, self._strides, self._offset, (a.nbytes // self._dtype.itemsize,)
            )
        return d

    # -- construction

    @classmethod
    def from_pointer(
        cls,
        ptr: int,
        shape: Sequence[int],
        dtype: Any,
        strides: Sequence[int] | None = None,
        offset: int = 0,
        owner: Any = None,
        device: Device | int | None = None,
    ) -> DeviceArray:
        """Wrap device memory allocated elsewhere (a torch_npu tensor's ``data_ptr()``, say).

        ``ptr`` is the storage base, ``strides``/``offset`` are in elements. The memory is
        borrowed: it is never freed here, and ``owner`` is kept alive as long as any array
        viewing it, so the memory cannot go away underneath.
        """
        if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr <= 0:
            raise InvalidArgument("ptr", f"must be a positive integer device address, got {ptr!r}")
        dt = np.dtype(dtype)
        shp = _check_shape(shape)
        st = _contiguous_strides(shp) if strides is None else tuple(int(s) for s in strides)
        if len(st) != len(shp):
            raise InvalidArgument("strides", f"must have {len(shp)} entries, one per dimension, got {len(st)}")
        if any(s < 0 for s in st):
            raise InvalidArgument("strides", "must be non-negative (CANN views take non-negative strides)")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgument("offset", f"must be a non-negative int (elements), got {offset!r}")
        dev = _resolve_device(device)
        extent = offset + (sum((n - 1) * s for n, s in zip(shp, st)) + 1 if all(shp) else 0)
        alloc = _Allocation(dev, ptr, extent * dt.itemsize, owned=False, owner=owner)
        return cls(alloc, shp, dt, st, offset)

    # -- properties

    def _live_alloc(self) -> _Allocation:
        a = self._alloc
        if a is None:
            raise InvalidArgument("array", "this DeviceArray was closed")
        if not a.alive:
            raise InvalidArgument(
                "array", f"the memory of this DeviceArray is gone: device {a.device.device_id} was closed"
            )
        return a

    @property
    def device(self) -> Device:
        return self._live_alloc().device

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        return self._strides

    @property
    def offset(self) -> int:
        """Offset of the first element from the storage base, in elements."""
        return self._offset

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64)) if self._shape else 1

    @property
    def itemsize(self) -> int:
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @property
    def acl_data_type(self) -> int:
        return self._acl_dtype

    @property
    def data_ptr(self) -> int:
        """The storage base address (what aclCreateTensor receives as tensorData)."""
        return self._live_alloc().ptr

    @property
    def address(self) -> int:
        """The device address of the first element."""
        a = self._live_alloc()
        return a.ptr + self._offset * self.itemsize

    @property
    def storage_size(self) -> int:
        """Elements in the underlying storage."""
        return self._live_alloc().nbytes // self.itemsize

    @property
    def owns_memory(self) -> bool:
        return self._live_alloc().owned

    @property
    def is_contiguous(self) -> bool:
        return _is_contiguous(self._shape, self._strides)

    @property
    def closed(self) -> bool:
        return self._alloc is None or not self._alloc.alive

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self._shape[0]

    def __repr__(self) -> str:
        if self.closed:
            return f"<DeviceArray closed shape={self._shape} dtype={self._dtype}>"
        a = self._alloc
        assert a is not None
        return (
            f"<DeviceArray shape={self._shape} dtype={self._dtype} strides={self._strides} "
            f"offset={self._offset} device={a.device.device_id} address={self.address:#x}>"
        )

    # -- views

    def __getitem__(self, key: Any) -> DeviceArray:
        """Basic slicing (ints, slices with positive steps, Ellipsis): a view, no copy."""
        self._live_alloc()
        if not isinstance(key, tuple):
            key = (key,)
        if sum(k is Ellipsis for k in key) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if Ellipsis in key:
            i = key.index(Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
        if len(key) > self.ndim:
            raise IndexError(f"too many indices: array is {self.ndim}-dimensional, got {len(key)}")
        shape, strides, offset = [], [], self._offset
        for d, k in enumerate(key):
            n, s = self._shape[d], self._strides[d]
            if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
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
            else:
                raise InvalidArgument("key", f"only ints, slices and '...' index a DeviceArray, got {type(k).__name__}")
        shape += self._shape[len(key) :]
        strides += self._strides[len(key) :]
        return DeviceArray(self._alloc, tuple(shape), self._dtype, tuple(strides), offset)  # type: ignore[arg-type]

    # -- copies

    def _extent(self) -> tuple[int, int]:
        """Element offsets [lo, hi] the view touches (hi < lo for an empty view)."""
        if not all(self._shape):
            return self._offset, self._offset - 1
        hi = self._offset + sum((n - 1) * s for n, s in zip(self._shape, self._strides))
        return self._offset, hi

    def to_host(self, stream: Stream | None = None) -> np.ndarray:
        """Copy to a new NumPy array.

        The copy runs on ``stream`` (default: the stream that last wrote this memory through
        pyacl_moe, else a synchronous copy) and waits for it, so earlier work queued there is
        visible.
        """
        a = self._live_alloc()
        out = np.empty(self._shape, dtype=self._dtype)
        lo, hi = self._extent()
        if hi < lo:
            return out
        nbytes = (hi - lo + 1) * self.itemsize
        src = a.ptr + lo * self.itemsize
        if self.is_contiguous:
            host = out
        else:
            host = np.empty(nbytes, dtype=np.uint8)
        s = stream if stream is not None else a.last_stream
        if s is not None and s.closed:
            s = None
        if s is not None:
            h = s._use()
            _ffi.memcpy_async(host.ctypes.data, nbytes, src, nbytes, _ffi.ACL_MEMCPY_DEVICE_TO_HOST, h)
            s._keep(host, a)  # the allocation, not the array: closing the array must not free it
            s.synchronize()
        else:
            a.device._activate()
            _ffi.memcpy(host.ctypes.data, nbytes, src, nbytes, _ffi.ACL_MEMCPY_DEVICE_TO_HOST)
        if host is not out:
            view = np.lib.stride_tricks.as_strided(
                host.view(self._dtype),
                shape=self._shape,
                strides=tuple(s * self.itemsize for s in self._strides),
            )
            out[...] = view
        return out

    def numpy(self, stream: Stream | None = None) -> np.ndarray:
        """Same as :meth:`to_host`."""
        return self.to_host(stream)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.to_host()
        return arr if dtype is None else arr.astype(dtype)

    def copy_from_host(self, array: Any, stream: Stream | None = None) -> None:
        """Overwrite this (contiguous) array with ``array``'s values, on ``stream`` if given."""
        a = self._live_alloc()
        if not self.is_contiguous:
            raise InvalidArgument("array", "copy_from_host needs a contiguous DeviceArray")
        host = _host_array(np.asarray(array), "array")
        if host.shape != self._shape or host.dtype != self._dtype:
            raise InvalidArgument(
                "array", f"must have shape {self._shape} and dtype {self._dtype}, got {host.shape} {host.dtype}"
            )
        _copy_in(a, self.address, host, stream)

    def close(self) -> None:
        """Drop this array's hold on the memory; it is freed once no array views it. Safe twice."""
        self._alloc = None


def _is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    if not all(shape):
        return True  # no elements: nothing is laid out
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shp = tuple(int(n) for n in shape)
    except TypeError:
        raise InvalidArgument("shape", f"must be a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in shp):
        raise InvalidArgument("shape", f"dimensions must be non-negative, got {shp}")
    return shp


def _host_array(array: np.ndarray, name: str) -> np.ndarray:
    """A C-contiguous, native-byte-order copy (or the array itself when it already is one)."""
    if array.dtype == object:
        raise InvalidArgument(name, "dtype object cannot go to the device")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    acl_data_type(array.dtype)
    return np.ascontiguousarray(array)


def _allocate(device: Device, nbytes: int) -> _Allocation:
    device._activate()
    # aclrtMalloc rejects 0 bytes; an empty array still gets a (tiny) block of its own.
    ptr = _ffi.malloc(max(nbytes, 1))
    try:
        return _Allocation(device, ptr, nbytes, owned=True)
    except BaseException:
        _ffi.free(ptr)
        raise


def _pin(array: DeviceArray | None) -> _Allocation | None:
    """What queued work must keep alive for an array: its allocation (closing the array only
    drops the array's own hold)."""
    return array._alloc if array is not None else None


def _copy_in(alloc: _Allocation, dst: int, host: np.ndarray, stream: Stream | None) -> None:
    n = host.nbytes
    if n == 0:
        return
    if stream is not None:
        h = stream._use()
        _ffi.memcpy_async(dst, n, host.ctypes.data, n, _ffi.ACL_MEMCPY_HOST_TO_DEVICE, h)
        stream._keep(host, alloc)
        alloc.last_stream = stream
    else:
        alloc.device._activate()
        _ffi.memcpy(dst, n, host.ctypes.data, n, _ffi.ACL_MEMCPY_HOST_TO_DEVICE)


def empty(shape: Any, dtype: Any, device: Device | int | None = None) -> DeviceArray:
    """A new contiguous DeviceArray with uninitialized contents."""
    shp = _check_shape(shape)
    dt = np.dtype(dtype)
    acl_data_type(dt)
    dev = _resolve_device(device)
    nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize if shp else dt.itemsize
    alloc = _allocate(dev, nbytes)
    return DeviceArray(alloc, shp, dt, _contiguous_strides(shp), 0)


def zeros(shape: Any, dtype: Any, device: Device | int | None = None, stream: Stream | None = None) -> DeviceArray:
    """A new contiguous DeviceArray of zeros (memset on ``stream`` if given, else now)."""
    arr = empty(shape, dtype, device)
    a = arr._live_alloc()
    n = a.nbytes
    try:
        if n:
            if stream is not None:
                _ffi.memset_async(a.ptr, n, 0, n, stream._use())
                stream._keep(a)  # the memset writes it when the stream runs
                a.last_stream = stream
            else:
                _ffi.memset(a.ptr, n, 0, n)
    except BaseException:
        a._release()  # now, not whenever the traceback lets go of it
        raise
    return arr


def to_device(array: Any, stream: Stream | None = None, device: Device | int | None = None) -> DeviceArray:
    """Copy a NumPy array (or anything np.asarray takes) to a new contiguous DeviceArray.

    Fortran-ordered, strided or byte-swapped input is first made C-contiguous and native on
    the host. With ``stream`` the copy is queued on it (and the host data kept alive until the
    stream is synchronized); without, it is done before returning.
    """
    host = _host_array(np.asarray(array), "array")
    dev = stream.device if stream is not None and device is None else _resolve_device(device)
    if stream is not None and stream.device is not dev:
        raise InvalidArgument("stream", f"belongs to device {stream.device.device_id}, not {dev.device_id}")
    alloc = _allocate(dev, host.nbytes)
    arr = DeviceArray(alloc, host.shape, host.dtype, _contiguous_strides(host.shape), 0)
    try:
        _copy_in(alloc, alloc.ptr, host, stream)
    except BaseException:
        alloc._release()  # now, not whenever the traceback lets go of it
        raise
    return arr


# ---------------------------------------------------------------------------- workspace pool

class _Block:
    """A workspace block of the pool, tagged with the stream that last used it."""

    __slots__ = ("alloc", "nbytes", "stream", "__weakref__")

    def __init__(self, alloc: _Allocation, nbytes: int) -> None:
        self.alloc = alloc
        self.nbytes = nbytes
        self.stream: Stream | None = None

    @property
    def address(self) -> int:
        return self.alloc.ptr


class _WorkspacePool:
    """A per-device, stream-ordered cache of workspace blocks.

    A block returns to the pool as soon as its kernel is queued: work queued later on the same
    stream runs after that kernel, so the same stream may take it again at once, without any
    synchronization. Another stream gets it only behind an event recorded on the stream that
    used it (aclrtStreamWaitEvent), so it never runs before that stream's kernel is done. Only a
    miss calls aclrtMalloc.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        # Re-entrant: a plan collected by the garbage collector gives its blocks back from
        # its finalizer, which may run while this thread is inside the pool.
        self.lock = threading.RLock()
        # The block each stream released last: the steady state takes and gives it back
        # without searching (dict operations are atomic under the GIL).
        self.hot: dict[Stream, _Block] = {}
        self.free: list[_Block] = []
        # Every block the pool made, free or lent: reachable from here (the pool is reachable
        # from the module), so the collector never frees a workspace a queued kernel uses, even
        # when the plan holding it is caught in a reference cycle.
        self.owned: set[_Block] = set()
        self.lent = 0
        self.bytes_held = 0
        self.hits = 0
        self.misses = 0
        self.cross_stream = 0

    def acquire(self, nbytes: int, stream: Stream) -> _Block:
        block = self.hot.pop(stream, None)
        if block is not None:
            if nbytes <= block.nbytes <= 2 * nbytes + (1 << 20) and block.alloc.alive:
                self.hits += 1
                self.lent += 1
                return block
            with self.lock:
                self.free.append(block)
        with self.lock:
            self.free.extend(self.hot.pop(s) for s in [s for s in list(self.hot) if s.closed])
            same = other = None
            for b in self.free:
                if b.nbytes < nbytes or b.nbytes > 2 * nbytes + (1 << 20):
                    continue  # too small, or would waste too much
                owner = b.stream
                if owner is None or owner is stream or owner.closed:
                    if same is None or b.nbytes < same.nbytes:
                        same = b
                elif other is None or b.nbytes < other.nbytes:
                    other = b
            for s, b in list(self.hot.items()):  # other streams' hot blocks are candidates too
                if s is not stream and nbytes <= b.nbytes <= 2 * nbytes + (1 << 20):
                    if other is None or b.nbytes < other.nbytes:
                        other = b
            block = same or other
            if block is not None:
                if block in self.free:
                    self.free.remove(block)
                else:
                    for s, b in list(self.hot.items()):
                        if b is block:
                            del self.hot[s]
                self.lent += 1
                self.hits += 1
                if block is other:
                    self.cross_stream += 1
        if block is None:
            alloc = _allocate(self.device, nbytes)
            block = _Block(alloc, nbytes)
            with self.lock:
                self.owned.add(block)
                self.misses += 1
                self.lent += 1
                self.bytes_held += nbytes
        elif block is other:
            try:
                self._wait_for(block.stream, stream)  # type: ignore[arg-type]
            except BaseException:
                self.release(block, block.stream)  # type: ignore[arg-type]
                raise
        block.stream = stream
        return block

    def _wait_for(self, owner: Stream, stream: Stream) -> None:
        """Stream order across streams: ``stream`` waits for an event recorded behind whatever
        ``owner`` queued. A stream closed meanwhile needs no event: closing waited for it."""
        from .runtime import Event

        ev = Event(self.device)
        try:
            ev.record(owner)
            stream.wait_event(ev)
        except Exception:
            ev.close()
            if owner.closed:
                return
            raise
        stream._keep(ev)  # destroyed once the waiting stream has been synchronized

    def release(self, block: _Block, stream: Stream) -> None:
        block.stream = stream
        self.lent -= 1
        if not block.alloc.alive:
            with self.lock:
                if block in self.owned:
                    self.owned.discard(block)
                    self.bytes_held -= block.nbytes
            return
        previous = self.hot.get(stream)
        self.hot[stream] = block
        if previous is not None and previous is not block:
            with self.lock:
                self.free.append(previous)

    def empty(self) -> None:
        # A block is idle in the pool as soon as its kernel is queued, not when it has run:
        # wait for the device before handing memory back to CANN.
        if not self.device.closed:
            self.device.synchronize()
        with self.lock:
            blocks, self.free = self.free + list(self.hot.values()), []
            self.hot = {}
            self.owned.difference_update(blocks)
            self.bytes_held -= sum(b.nbytes for b in blocks)
        for b in blocks:
            if b.alloc.alive:
                b.alloc._release()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "cross_stream_reuses": self.cross_stream,
                "blocks_free": len(self.free) + len(self.hot),
                "blocks_in_use": self.lent,
                "bytes_held": self.bytes_held,
            }


_pools: dict[int, tuple[Device, _WorkspacePool]] = {}
_pools_lock = threading.Lock()


def _pool(device: Device) -> _WorkspacePool:
    with _pools_lock:
        for key in [k for k, (d, _) in _pools.items() if d.closed]:
            del _pools[key]  # its blocks went with the device
        entry = _pools.get(id(device))
        if entry is None or entry[0] is not device:
            entry = (device, _WorkspacePool(device))
            _pools[id(device)] = entry
        return entry[1]


def memory_stats(device: Device | int | None = None) -> dict[str, int]:
    """The workspace pool's figures for a device (default: the current one): hits, misses,
    cross-stream reuses, blocks free and in use, bytes held."""
    return _pool(_resolve_device(device)).stats()


def _empty_pools(device: Device | None = None) -> None:
    """Free the pools' idle workspace blocks (all devices if ``device`` is None)."""
    if device is None:
        with _pools_lock:
            pools = [p for d, p in _pools.values() if not d.closed]
        for p in pools:
            p.empty()
    else:
        _pool(device).empty()
