"""Thin wrappers of acl.h and acl_rt.h: process set-up, devices and contexts, streams, events,
memory and copies. One function per CANN call, every status checked.

Device and host addresses cross this boundary as ints; contexts and created objects as the
:class:`Handle` objects below, which only this layer looks into. ``None`` stands for the
default stream (CANN's NULL stream).
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import declare, loader
from .errcheck import check, recent_message

__all__ = [
    "BorrowedStreamHandle", "Context", "DeviceMemory", "EventHandle", "Handle", "HostMemory", "StreamHandle",
    "call_probe", "create_event", "create_stream", "device_count", "event_elapsed_ms", "finalize", "forked",
    "get_mem_info", "get_version", "has_version_str", "init", "interrupts_deferred", "malloc", "malloc_host",
    "memcpy_async", "memset_async", "open_device", "query_event", "query_stream", "raw", "record_event",
    "reset_device", "soc_name", "stream_wait_event", "synchronize_device", "synchronize_event",
    "synchronize_stream", "thread_state", "use_context", "version_str", "void",
]

_ffi = declare.ffi
_NULL = declare.NULL


class _ThreadState(threading.local):
    context: Context | None = None  # the context this process last made current on the thread


# The calling thread's current context, as far as this process set it: read it to skip a call
# when the right context is already current; only use_context writes it.
thread_state = _ThreadState()

# Set once: aclInit was called in this process ([0]), this is a fork() child of such a
# process ([1]). Each is one store of True, never cleared.
_initialized = [False]
_forked = [False]

# Every Context opened, so that a fork() child can mark them dead. Guarded by _contexts_lock.
_contexts: weakref.WeakSet[Context] = weakref.WeakSet()
_contexts_lock = threading.Lock()


_VOIDP = _ffi.typeof("void *")  # (parsed at import: see declare's docstring)
_cast = _ffi.cast


def void(address: int) -> Any:
    """A device or host address as the ``void *`` a C call takes (opaque above this layer)."""
    return _cast(_VOIDP, address)


def raw(h: Handle | None) -> Any:
    """A handle's C value as a call takes it (NULL for None: the default stream); opaque above
    this layer."""
    return _NULL if h is None else h._slot[0]


def forked() -> bool:
    """Whether this process is a fork() child of one that initialized CANN (which does not
    survive fork: every object inherited is dead)."""
    return _forked[0]


# ---------------------------------------------------------------------------- acl.h

def init() -> bool:
    """aclInit(NULL). True if this call initialized CANN, False if it already was (a framework
    in the same process called aclInit)."""
    st = loader.libs().acl.aclInit(_NULL)
    if st == declare.const("ACL_ERROR_REPEAT_INITIALIZE"):
        recent_message()  # consume it: not an error for us
    else:
        check(st, "aclInit")
    _initialized[0] = True
    return not st


def finalize() -> None:
    check(loader.libs().acl.aclFinalize(), "aclFinalize")


def get_version() -> tuple[int, int, int]:
    v = _ffi.new(declare.ctype("int32_t[]"), 3)
    check(loader.libs().acl.aclrtGetVersion(v, v + 1, v + 2), "aclrtGetVersion")
    return (int(v[0]), int(v[1]), int(v[2]))


def has_version_str() -> bool:
    """Whether the runtime exports aclsysGetVersionStr (8.5 and later)."""
    return hasattr(loader.libs().acl, "aclsysGetVersionStr")


def version_str(package: str) -> str | None:
    """aclsysGetVersionStr(package): the package's Version= from the share/info of the home
    ``$ASCEND_HOME_PATH`` names, or None when the runtime has no such package (100003). Only
    for a runtime that has the function (:func:`has_version_str`: the caller asks first)."""
    buf = _ffi.new(declare.ctype("char[]"), declare.const("ACL_PKG_VERSION_MAX_SIZE"))
    name = _ffi.new(declare.ctype("char[]"), package.encode())
    if loader.libs().acl.aclsysGetVersionStr(name, buf):
        recent_message()  # consume it: a package the install lacks is an answer, not an error
        return None
    return declare.text(buf) or None


def soc_name() -> str | None:
    p = loader.libs().acl.aclrtGetSocName()
    return declare.text(p) if p != _NULL else None


def call_probe() -> tuple[Callable[..., int], Any]:
    """A bare foreign call and its argument (aclrtGetDevice): the unit host costs are
    measured in."""
    return loader.libs().acl.aclrtGetDevice, _ffi.new(declare.ctype("int32_t *"))


# ---------------------------------------------------------------------------- devices, contexts

def device_count() -> int:
    n = _ffi.new(declare.ctype("uint32_t *"))
    check(loader.libs().acl.aclrtGetDeviceCount(n), "aclrtGetDeviceCount")
    return int(n[0])


class Context:
    """One opening of a device: its default context (made by aclrtSetDevice). Threads switch
    to it with aclrtSetCurrentContext, which leaves the device's reference count alone.
    ``open``: the device takes new work (the device layer clears it when it closes or resets);
    ``alive``: its objects exist in CANN (False once the device is reset, or in a fork()
    child). Each flag starts True (only open_device makes one, and keeps it only once its
    device is set) and takes one store of False, never set back."""

    __slots__ = ("device_id", "_slot", "alive", "open", "__weakref__")

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._slot = _ffi.new(declare.ctype("void **"))  # (an aclrtContext *)
        self.alive = self.open = True


def open_device(device_id: int) -> Context:
    """aclrtSetDevice on the calling thread (the one reference this process takes), then its
    default context, now current on this thread."""
    lib = loader.libs().acl
    ctx = Context(device_id)
    check(lib.aclrtSetDevice(device_id), "aclrtSetDevice")
    try:
        check(lib.aclrtGetCurrentContext(ctx._slot), "aclrtGetCurrentContext")
    except BaseException:
        lib.aclrtResetDevice(device_id)
        raise
    with _contexts_lock:
        _contexts.add(ctx)
    thread_state.context = ctx
    return ctx


def reset_device(ctx: Context) -> None:
    """aclrtResetDevice for the reference open_device took: the context and every object of
    it die with it."""
    ctx.open = ctx.alive = False
    if thread_state.context is ctx:
        thread_state.context = None
    check(loader.libs().acl.aclrtResetDevice(ctx.device_id), "aclrtResetDevice")


def use_context(ctx: Context) -> None:
    """Make ``ctx`` the calling thread's current context (nothing if it already is)."""
    if thread_state.context is not ctx:
        check(loader.libs().acl.aclrtSetCurrentContext(ctx._slot[0]), "aclrtSetCurrentContext")
        thread_state.context = ctx


def synchronize_device() -> None:
    check(loader.libs().acl.aclrtSynchronizeDevice(), "aclrtSynchronizeDevice")


def get_mem_info() -> tuple[int, int]:
    """aclrtGetMemInfo(ACL_HBM_MEM): (free, total) bytes of the current device."""
    free, total = _ffi.new(declare.ctype("size_t *")), _ffi.new(declare.ctype("size_t *"))
    check(loader.libs().acl.aclrtGetMemInfo(declare.const("ACL_HBM_MEM"), free, total), "aclrtGetMemInfo")
    return int(free[0]), int(total[0])


# ---------------------------------------------------------------------------- handles

class Handle:
    """A CANN object's handle. The C call that creates the object writes the handle's slot (an
    out-parameter), so the object has an owner from the moment it exists. :meth:`release`
    destroys it; the caller makes that exactly once (the device's inventory does). A handle of
    a ``context`` dies with it: after its device's reset (or in a fork() child) there is
    nothing left to release."""

    __slots__ = ("_slot", "context", "__weakref__")
    SLOT_TYPE = "void **"  # (aclrtStream, aclrtEvent: void * too)
    LIBRARY, API = "acl", ""  # the library and the CANN function that releases it
    RELEASED_ANYWAY: frozenset[int] = frozenset()  # failures after which the object is gone all the same

    def __init__(self, context: Context | None = None) -> None:
        self._slot = _ffi.new(declare.ctype(self.SLOT_TYPE))
        self.context = context

    @property
    def address(self) -> int:
        """The handle as an integer (0 when released or never created)."""
        return int(_ffi.cast(declare.ctype("uintptr_t"), self._slot[0]))

    def __bool__(self) -> bool:
        return bool(self._slot[0] != _NULL)

    def forget(self) -> None:
        """Drop the handle without releasing it: CANN took it (a one-shot executor's launch)."""
        self._slot[0] = _NULL

    def release(self) -> int:
        """Destroy the object; CANN's status. A handle CANN refused to release goes back in the
        slot, so that a later call tries again; the slot is emptied with the call, interrupts
        held back between the two (a handle destroyed and still in its slot would be used)."""
        h, ctx = self._slot[0], self.context
        if h == _NULL or _forked[0] or (ctx is not None and not ctx.alive):
            self._slot[0] = _NULL  # never made, or gone with its device (or not this process's to touch)
            return 0
        if ctx is not None:
            use_context(ctx)
        fn = getattr(getattr(loader.libs(), self.LIBRARY), self.API)
        with interrupts_deferred():
            self._slot[0] = _NULL
            status = int(fn(h))
            if status and status not in self.RELEASED_ANYWAY:
                self._slot[0] = h
        return status


class StreamHandle(Handle):
    __slots__ = ()
    API = "aclrtDestroyStream"


class BorrowedStreamHandle(StreamHandle):
    """An aclrtStream created by someone else (torch_npu, another library): used, never
    destroyed."""

    __slots__ = ()

    def __init__(self, context: Context, address: int) -> None:
        super().__init__(context)
        self._slot[0] = void(address)

    def release(self) -> int:
        self.forget()  # its creator destroys it
        return 0


class EventHandle(Handle):
    __slots__ = ()
    API = "aclrtDestroyEvent"


class DeviceMemory(Handle):
    """A device allocation (aclrtMalloc)."""

    __slots__ = ()
    API = "aclrtFree"
    RELEASED_ANYWAY = frozenset({507053})  # memory whose guard bytes were overwritten: freed, and reported


class HostMemory(Handle):
    """Pinned host memory (aclrtMallocHost), released under its device's context."""

    __slots__ = ()
    API = "aclrtFreeHost"


class interrupts_deferred:
    """Hold SIGINT's Python handler back across a C call whose outcome must be recorded with
    it (a new handle stored, a destroyed or consumed one forgotten): a KeyboardInterrupt raised
    between the two would lose the object, or leave a dead handle in use. Python runs signal
    handlers on the main thread only, so elsewhere this does nothing; a SIGINT that arrived
    meanwhile is handed to the handler on exit."""

    __slots__ = ("saved", "hit")

    def __enter__(self) -> None:
        self.saved: Any = None
        # (a handler that is SIG_IGN or SIG_DFL runs no Python code: nothing to hold back)
        if threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT)):
            self.hit: list[tuple[int, Any]] = []  # (signum, frame) of each SIGINT held back
            self.saved = signal.signal(signal.SIGINT, lambda *hit: self.hit.append(hit))  # (it returns the handler)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            signal.signal(signal.SIGINT, self.saved)
            if self.hit:
                self.saved(*self.hit[-1])


# ---------------------------------------------------------------------------- streams

def create_stream(h: StreamHandle) -> None:
    check(loader.libs().acl.aclrtCreateStream(h._slot), "aclrtCreateStream")


def synchronize_stream(h: StreamHandle | None, timeout_ms: int | None = None) -> None:
    acl = loader.libs().acl
    if timeout_ms is None:
        check(acl.aclrtSynchronizeStream(raw(h)), "aclrtSynchronizeStream")
    else:
        check(acl.aclrtSynchronizeStreamWithTimeout(raw(h), timeout_ms), "aclrtSynchronizeStreamWithTimeout")


def query_stream(h: StreamHandle | None) -> bool:
    """aclrtStreamQuery: True when everything queued on the stream has run."""
    status = _ffi.new(declare.ctype("aclrtStreamStatus *"))
    check(loader.libs().acl.aclrtStreamQuery(raw(h), status), "aclrtStreamQuery")
    return int(status[0]) == declare.const("ACL_STREAM_STATUS_COMPLETE")


def stream_wait_event(event: EventHandle, h: StreamHandle | None) -> None:
    """aclrtStreamWaitEvent (the stream last, as in every call that queues a task)."""
    check(loader.libs().acl.aclrtStreamWaitEvent(raw(h), event._slot[0]), "aclrtStreamWaitEvent")


# ---------------------------------------------------------------------------- events

def create_event(h: EventHandle) -> None:
    check(loader.libs().acl.aclrtCreateEvent(h._slot), "aclrtCreateEvent")


def record_event(event: EventHandle, stream: StreamHandle | None) -> None:
    check(loader.libs().acl.aclrtRecordEvent(event._slot[0], raw(stream)), "aclrtRecordEvent")


def synchronize_event(event: EventHandle) -> None:
    check(loader.libs().acl.aclrtSynchronizeEvent(event._slot[0]), "aclrtSynchronizeEvent")


def query_event(event: EventHandle) -> bool:
    """aclrtQueryEventStatus: True when the work recorded before the event has run."""
    status = _ffi.new(declare.ctype("aclrtEventRecordedStatus *"))
    check(loader.libs().acl.aclrtQueryEventStatus(event._slot[0], status), "aclrtQueryEventStatus")
    return int(status[0]) == declare.const("ACL_EVENT_RECORDED_STATUS_COMPLETE")


def event_elapsed_ms(start: EventHandle, end: EventHandle) -> float:
    ms = _ffi.new(declare.ctype("float *"))
    check(loader.libs().acl.aclrtEventElapsedTime(ms, start._slot[0], end._slot[0]), "aclrtEventElapsedTime")
    return float(ms[0])


# ---------------------------------------------------------------------------- memory

def malloc(mem: DeviceMemory, size: int) -> int:
    """aclrtMalloc(size) into ``mem`` (huge pages first, CANN's default policy); the address."""
    check(loader.libs().acl.aclrtMalloc(mem._slot, size, declare.const("ACL_MEM_MALLOC_HUGE_FIRST")), "aclrtMalloc")
    return mem.address


def malloc_host(mem: HostMemory, size: int) -> int:
    """aclrtMallocHost(size) into ``mem``; the address."""
    check(loader.libs().acl.aclrtMallocHost(mem._slot, size), "aclrtMallocHost")
    return mem.address


def memcpy_async(dst: int, dst_max: int, src: int, count: int, kind: str, stream: StreamHandle | None) -> None:
    st = loader.libs().acl.aclrtMemcpyAsync(_cast(_VOIDP, dst), dst_max, _cast(_VOIDP, src), count,
                                            declare.const(kind),  # (cached: a hit is no Python frame)
                                            _NULL if stream is None else stream._slot[0])  # (inlined: the copies' path)
    if st:  # (the common case costs no call: this is the NumPy call's copies' path)
        check(st, "aclrtMemcpyAsync")


def memset_async(ptr: int, max_count: int, value: int, count: int, stream: StreamHandle | None) -> None:
    check(loader.libs().acl.aclrtMemsetAsync(void(ptr), max_count, value, count, raw(stream)),
          "aclrtMemsetAsync")


# ---------------------------------------------------------------------------- fork

def _after_fork_in_child() -> None:
    # CANN does not survive fork: if this process initialized it, every context the child
    # inherits is dead, and no call of the child may reach its objects. The runtime above
    # checks a context's ``open`` before it takes any lock, so the child never waits on a lock
    # a parent thread held at fork; this is the one at-fork hook of the package.
    global _contexts_lock
    _contexts_lock = threading.Lock()  # a parent thread may have held it
    loader.after_fork_in_child()
    thread_state.__dict__.clear()
    if _initialized[0]:
        _forked[0] = True
        for ctx in list(_contexts):
            ctx.open = ctx.alive = False


os.register_at_fork(after_in_child=_after_fork_in_child)
