"""Thin wrappers of acl.h and acl_rt.h: process set-up, devices and contexts, streams, events,
memory and copies. One function per CANN call, every status checked.

Device and host addresses cross this boundary as ints; streams, events, contexts and device
memory as the handle objects below, which only this layer looks into. ``None`` stands for the
default stream (CANN's NULL stream).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import declare, handles, loader
from .errcheck import check, recent_message

__all__ = [
    "Context", "DeviceMemory", "EventHandle", "StreamHandle", "call_probe", "create_event", "create_stream",
    "device_count", "event_elapsed_ms", "finalize",
    "get_mem_info", "get_version", "has_version_str", "init", "malloc", "memcpy", "memcpy_async", "memset",
    "memset_async",
    "open_device", "query_event", "query_stream", "record_event", "reset_device", "soc_name", "synchronize_device",
    "synchronize_event", "synchronize_stream", "stream_wait_event", "thread_state", "use_context", "version_str",
]

_ffi = declare.ffi
_NULL = declare.NULL

class _ThreadState(threading.local):
    context: Context | None = None  # the context this process last made current on the thread


# The calling thread's current context, as far as this process set it. Read it (e.g. to skip a
# call when the right context is already current); only use_context writes it.
thread_state = _ThreadState()

_initialized_here = [False]  # aclInit was called in this process (by anyone we saw)

# Every Context opened, marked dead in a fork() child. ``_contexts_lock`` guards it.
_contexts: weakref.WeakSet[Context] = weakref.WeakSet()
_contexts_lock = threading.Lock()


def _void(address: int) -> Any:
    return _ffi.cast(declare.ctype("void *"), address)


# ---------------------------------------------------------------------------- acl.h

def init() -> bool:
    """aclInit(NULL). True if this call initialized CANN, False if it already was (a framework
    in the same process called aclInit)."""
    st = loader.libs().acl.aclInit(_NULL)
    _initialized_here[0] = True
    if st == declare.const("ACL_ERROR_REPEAT_INITIALIZE"):
        recent_message()  # consume it: not an error for us
        return False
    if st:
        _initialized_here[0] = False
    check(st, "aclInit")
    return True


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
    ``$ASCEND_HOME_PATH`` names, or None when the runtime has no such package (100003) or no
    such function."""
    if not has_version_str():
        return None
    buf = _ffi.new(declare.ctype("char[]"), declare.const("ACL_PKG_VERSION_MAX_SIZE"))
    name = _ffi.new(declare.ctype("char[]"), package.encode())
    st = loader.libs().acl.aclsysGetVersionStr(name, buf)
    if st:
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
    """A device's default context (made by aclrtSetDevice). Threads switch to it with
    aclrtSetCurrentContext, which leaves the device's reference count alone, so switching
    devices any number of times costs no aclrtSetDevice. ``alive`` turns False when the device
    is reset (or in a fork() child); a dead context is never made current again."""

    __slots__ = ("device_id", "_slot", "alive", "__weakref__")

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._slot = _ffi.new(declare.ctype("aclrtContext *"))
        self.alive = False


def open_device(device_id: int) -> Context:
    """aclrtSetDevice on the calling thread (the device's one reference this process takes),
    then its default context, now current on this thread."""
    lib = loader.libs().acl
    ctx = Context(device_id)
    check(lib.aclrtSetDevice(device_id), "aclrtSetDevice")
    ctx.alive = True
    with _contexts_lock:
        _contexts.add(ctx)
    try:
        check(lib.aclrtGetCurrentContext(ctx._slot), "aclrtGetCurrentContext")
    except BaseException:
        ctx.alive = False
        lib.aclrtResetDevice(device_id)
        raise
    thread_state.context = ctx
    return ctx


def reset_device(ctx: Context) -> None:
    """aclrtResetDevice for the reference open_device took; the context dies with it."""
    ctx.alive = False
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


def get_mem_info(attr: str = "ACL_HBM_MEM") -> tuple[int, int]:
    free, total = _ffi.new(declare.ctype("size_t *")), _ffi.new(declare.ctype("size_t *"))
    check(loader.libs().acl.aclrtGetMemInfo(declare.const(attr), free, total), "aclrtGetMemInfo")
    return int(free[0]), int(total[0])


class _ContextHandle(handles.Handle):
    """A handle released under its device's context."""

    __slots__ = ("context",)

    def __init__(self, context: Context) -> None:
        super().__init__()
        self.context = context

    def _prepare(self) -> bool:
        ctx = self.context
        if not ctx.alive:
            return False  # the device's reset released it
        use_context(ctx)
        return True


# ---------------------------------------------------------------------------- streams

class StreamHandle(_ContextHandle):
    __slots__ = ()
    SLOT_TYPE = "aclrtStream *"
    API = "aclrtDestroyStream"

    def _release_function(self) -> Callable[[Any], int]:
        fn: Callable[[Any], int] = loader.libs().acl.aclrtDestroyStream
        return fn


class BorrowedStreamHandle(StreamHandle):
    """An aclrtStream created by someone else (torch_npu, another library): used, never
    destroyed."""

    __slots__ = ()

    def __init__(self, context: Context, address: int) -> None:
        super().__init__(context)
        self._slot[0] = _ffi.cast(declare.ctype("void *"), address)

    def release(self) -> int:
        self.forget()  # its creator destroys it
        return 0


def _stream(h: StreamHandle | None) -> Any:
    return _NULL if h is None else h._slot[0]


def create_stream(h: StreamHandle) -> None:
    check(loader.libs().acl.aclrtCreateStream(h._slot), "aclrtCreateStream")


def synchronize_stream(h: StreamHandle | None, timeout_ms: int | None = None) -> None:
    acl = loader.libs().acl
    if timeout_ms is None:
        check(acl.aclrtSynchronizeStream(_stream(h)), "aclrtSynchronizeStream")
    else:
        check(acl.aclrtSynchronizeStreamWithTimeout(_stream(h), timeout_ms), "aclrtSynchronizeStreamWithTimeout")


def query_stream(h: StreamHandle | None) -> bool:
    """aclrtStreamQuery: True when everything queued on the stream has run."""
    status = _ffi.new(declare.ctype("aclrtStreamStatus *"))
    check(loader.libs().acl.aclrtStreamQuery(_stream(h), status), "aclrtStreamQuery")
    return int(status[0]) == declare.const("ACL_STREAM_STATUS_COMPLETE")


def stream_wait_event(event: EventHandle, h: StreamHandle | None) -> None:
    """aclrtStreamWaitEvent (the stream last, as in every call that queues a task)."""
    check(loader.libs().acl.aclrtStreamWaitEvent(_stream(h), event._slot[0]), "aclrtStreamWaitEvent")


# ---------------------------------------------------------------------------- events

class EventHandle(_ContextHandle):
    __slots__ = ()
    SLOT_TYPE = "aclrtEvent *"
    API = "aclrtDestroyEvent"

    def _release_function(self) -> Callable[[Any], int]:
        fn: Callable[[Any], int] = loader.libs().acl.aclrtDestroyEvent
        return fn


def create_event(h: EventHandle) -> None:
    check(loader.libs().acl.aclrtCreateEvent(h._slot), "aclrtCreateEvent")


def record_event(event: EventHandle, stream: StreamHandle | None) -> None:
    check(loader.libs().acl.aclrtRecordEvent(event._slot[0], _stream(stream)), "aclrtRecordEvent")


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

class DeviceMemory(_ContextHandle):
    """A device allocation (aclrtMalloc); ``ptr`` is its address as an int."""

    __slots__ = ("ptr",)
    API = "aclrtFree"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.ptr = 0

    def _release_function(self) -> Callable[[Any], int]:
        fn: Callable[[Any], int] = loader.libs().acl.aclrtFree
        return fn


def malloc(mem: DeviceMemory, size: int) -> None:
    """aclrtMalloc(size) into ``mem`` (huge pages first, CANN's default policy)."""
    check(loader.libs().acl.aclrtMalloc(mem._slot, size, declare.const("ACL_MEM_MALLOC_HUGE_FIRST")), "aclrtMalloc")
    mem.ptr = mem.address


class HostMemory(_ContextHandle):
    """Pinned host memory (aclrtMallocHost); ``ptr`` is its address as an int. Released under
    its device's context, before the device is reset."""

    __slots__ = ("ptr",)
    API = "aclrtFreeHost"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.ptr = 0

    def _release_function(self) -> Callable[[Any], int]:
        fn: Callable[[Any], int] = loader.libs().acl.aclrtFreeHost
        return fn


def malloc_host(mem: HostMemory, size: int) -> None:
    """aclrtMallocHost(size) into ``mem``."""
    check(loader.libs().acl.aclrtMallocHost(mem._slot, size), "aclrtMallocHost")
    mem.ptr = mem.address


def memcpy(dst: int, dst_max: int, src: int, count: int, kind: str) -> None:
    """aclrtMemcpy; ``kind`` names an aclrtMemcpyKind (e.g. 'ACL_MEMCPY_HOST_TO_DEVICE')."""
    check(loader.libs().acl.aclrtMemcpy(_void(dst), dst_max, _void(src), count, declare.const(kind)), "aclrtMemcpy")


def memcpy_async(dst: int, dst_max: int, src: int, count: int, kind: str, stream: StreamHandle | None) -> None:
    check(
        loader.libs().acl.aclrtMemcpyAsync(_void(dst), dst_max, _void(src), count, declare.const(kind),
                                           _stream(stream)),
        "aclrtMemcpyAsync",
    )


def memset(ptr: int, max_count: int, value: int, count: int) -> None:
    check(loader.libs().acl.aclrtMemset(_void(ptr), max_count, value, count), "aclrtMemset")


def memset_async(ptr: int, max_count: int, value: int, count: int, stream: StreamHandle | None) -> None:
    check(loader.libs().acl.aclrtMemsetAsync(_void(ptr), max_count, value, count, _stream(stream)),
          "aclrtMemsetAsync")


# ---------------------------------------------------------------------------- fork

def _after_fork_in_child() -> None:
    # CANN does not survive fork: if this process initialized it, every handle and context the
    # child inherits is dead, and no call of the child may reach them.
    global _contexts_lock
    _contexts_lock = threading.Lock()  # a parent thread may have held it
    if _initialized_here[0]:
        handles.mark_process_forked()
        for ctx in list(_contexts):
            ctx.alive = False
    thread_state.__dict__.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
