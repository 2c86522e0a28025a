"""The bindings layer: the FFI object, the library search, dlopen, and one thin function per
CANN call.

This is the only module that touches cffi. Everything above it passes and receives plain
Python values: ints for device and host addresses, and opaque handles (cdata it never looks
into) for streams, events, tensors and executors. Every status is checked here and turned into
an exception by :mod:`pyacl_moe.errors`, with the vendor's message.

Nothing is loaded at import. The first call that needs CANN loads it once, thread-safely, from
the first of: ``load(ascend_home=...)``; ``$ASCEND_HOME_PATH``; ``$ASCEND_TOOLKIT_HOME``;
``/usr/local/Ascend/ascend-toolkit/latest``; the dynamic loader's own search path. With
``PYACL_MOE_EMULATOR=1`` or ``use_emulator()``, the bundled emulator is built (once) and loaded
instead.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cffi

from . import _paths, errors

LIBRARY_NAMES: tuple[str, ...] = ("ascendcl", "nnopbase", "opapi")
DEFAULT_TOOLKIT_HOME = "/usr/local/Ascend/ascend-toolkit/latest"

# Constants from headers/ that the layers above use.
ACL_HBM_MEM = 1
ACL_MEM_MALLOC_HUGE_FIRST = 0
ACL_MEMCPY_HOST_TO_HOST = 0
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
ACL_FORMAT_ND = 2
ACL_ERROR_REPEAT_INITIALIZE = 100002

ffi = cffi.FFI()
_NULL = ffi.NULL
_declared = False
_VOID_P = ffi.typeof("void *")
_cast_void = functools.partial(ffi.cast, _VOID_P)

# Every C type this module builds values of, parsed once when the declarations are read.
# cffi parses a type given as a string under an internal lock, and resolves a library
# function on first use under the same lock: a finalizer (a DeviceArray's aclrtFree, say) run
# by the garbage collector in the middle of such a parse would take the lock again and hang
# the thread. With every type pre-parsed and every function pre-resolved at load, calls made
# from finalizers need no lock.
_TYPE_NAMES = (
    "void *", "void **", "uintptr_t", "int32_t *", "int32_t[]", "uint32_t *", "size_t *", "float *",
    "int64_t *", "int64_t[]", "int64_t **", "uint64_t *", "aclrtStream *", "aclrtEvent *",
    "aclDataType *", "aclFormat *", "aclOpExecutor **", "aclemuStats *",
)
_CT: dict[str, Any] = {}


def _ctype(type_name: str) -> Any:
    ct = _CT.get(type_name)
    if ct is None:  # before anything was loaded: declare first (under the load lock)
        with _lock:
            _declare()
        ct = _CT[type_name]
    return ct


def _new(type_name: str, init: Any = None) -> Any:
    return ffi.new(_ctype(type_name), init)


def _cast(type_name: str, value: Any) -> Any:
    return ffi.cast(_ctype(type_name), value)


def _declare() -> None:
    """Feed headers/ (and the emulator's extras) to cdef, once. Done lazily so that importing
    the package reads no file and cannot fail."""
    global _declared
    if _declared:
        return
    for name in _paths.HEADER_FILES:
        ffi.cdef((_paths.headers_dir() / name).read_text())
    ffi.cdef((Path(__file__).resolve().parent / "emulator" / "src" / "aclemu.h").read_text())
    ffi.cdef("void free(void *);")
    for name in _TYPE_NAMES:
        _CT[name] = ffi.typeof(name)
    _declared = True


def _function_names() -> list[str]:
    text = "".join((_paths.headers_dir() / n).read_text() for n in _paths.HEADER_FILES)
    text += (Path(__file__).resolve().parent / "emulator" / "src" / "aclemu.h").read_text()
    return sorted(set(re.findall(r"\b(acl\w+)\s*\(", text)))


def _prime(libs: _Libs) -> None:
    """Resolve every declared function now (see _TYPE_NAMES for why)."""
    for name in _function_names():
        for lib in (libs.acl, libs.nn, libs.op):
            try:
                getattr(lib, name)
            except AttributeError:  # not in this library (or an emulator extra on a real CANN)
                continue


@dataclass(frozen=True)
class LibraryInfo:
    """Which CANN the process is bound to."""

    backend: str  # "emulator" or "cann"
    home: str | None  # the toolkit (or emulator) home, None when found by the loader's path
    paths: dict[str, str] = field(default_factory=dict)  # library name -> path given to dlopen


class _Libs:
    __slots__ = ("acl", "nn", "op", "info")

    def __init__(self, acl: Any, nn: Any, op: Any, info: LibraryInfo) -> None:
        self.acl, self.nn, self.op, self.info = acl, nn, op, info


_lock = threading.Lock()
_libs: _Libs | None = None
_want_emulator = False


def _env_wants_emulator() -> bool:
    return os.environ.get("PYACL_MOE_EMULATOR", "").strip().lower() in ("1", "true", "yes", "on")


def use_emulator() -> None:
    """Bind this process to the bundled emulator (built on first use) instead of a CANN install.

    Call before anything loads CANN; once the real libraries are loaded the choice is final.
    """
    global _want_emulator
    with _lock:
        if _libs is not None and _libs.info.backend != "emulator":
            raise RuntimeError(
                "CANN is already loaded from "
                f"{_libs.info.home or 'the loader path'}; use_emulator() must come first"
            )
        _want_emulator = True


def _dlopen_home(home: str, backend: str) -> _Libs:
    lib64 = Path(home) / "lib64"
    paths = {n: str(lib64 / f"lib{n}.so") for n in LIBRARY_NAMES}
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(", ".join(missing) + " not found")
    # In dependency order, so each library finds the ones it needs already loaded.
    acl, nn, op = (ffi.dlopen(paths[n]) for n in LIBRARY_NAMES)
    return _Libs(acl, nn, op, LibraryInfo(backend, str(Path(home)), paths))


def _search(ascend_home: str | None) -> _Libs:
    if ascend_home is not None:
        try:
            return _dlopen_home(ascend_home, "cann")
        except (OSError, FileNotFoundError) as exc:
            raise errors.CannNotFoundError([f"ascend_home={ascend_home!r}: {exc}"]) from None
    tried = []
    candidates = [
        ("$ASCEND_HOME_PATH", os.environ.get("ASCEND_HOME_PATH")),
        ("$ASCEND_TOOLKIT_HOME", os.environ.get("ASCEND_TOOLKIT_HOME")),
        ("default install", DEFAULT_TOOLKIT_HOME),
    ]
    for label, home in candidates:
        if not home:
            tried.append(f"{label}: not set")
            continue
        try:
            return _dlopen_home(home, "cann")
        except (OSError, FileNotFoundError) as exc:
            tried.append(f"{label} = {home}: {exc}")
    try:
        acl, nn, op = (ffi.dlopen(f"lib{n}.so") for n in LIBRARY_NAMES)
        return _Libs(acl, nn, op, LibraryInfo("cann", None, {n: f"lib{n}.so" for n in LIBRARY_NAMES}))
    except OSError as exc:
        tried.append(f"dynamic loader path (LD_LIBRARY_PATH, ld.so.cache): {exc}")
    raise errors.CannNotFoundError(tried)


def load(ascend_home: str | None = None, *, emulator: bool | None = None) -> LibraryInfo:
    """Load the CANN libraries now (otherwise the first call that needs them does).

    ``ascend_home``: a toolkit home holding lib64/ (what set_env.sh exports as
    ASCEND_HOME_PATH). ``emulator=True`` binds to the bundled emulator. Loading twice is a
    no-op if the choice is the same and an error otherwise.
    """
    global _libs, _want_emulator
    with _lock:
        want_emu = bool(emulator) or (emulator is None and (_want_emulator or _env_wants_emulator()))
        _declare()
        if _libs is not None:
            same = (_libs.info.backend == "emulator") == want_emu and (
                ascend_home is None or _libs.info.home == str(Path(ascend_home))
            )
            if not same and (emulator is not None or ascend_home is not None):
                raise RuntimeError(f"CANN is already loaded ({_libs.info}); it cannot be switched")
            return _libs.info
        if want_emu:
            from .emulator import _build

            libs = _dlopen_home(_build.build(), "emulator")
            _want_emulator = True
        else:
            libs = _search(ascend_home)
        _prime(libs)
        _libs = libs
        return libs.info


def _get() -> _Libs:
    libs = _libs
    if libs is None:
        load()
        libs = _libs
    return libs  # type: ignore[return-value]


def library_info() -> LibraryInfo:
    """Which libraries are loaded (loading them if needed)."""
    return _get().info


def loaded_info() -> LibraryInfo | None:
    """Which libraries are loaded, or None if nothing is loaded yet (loads nothing)."""
    return _libs.info if _libs is not None else None


# ---------------------------------------------------------------------------- status check

def _recent_message() -> str:
    libs = _libs
    if libs is None:
        return ""
    try:
        p = libs.acl.aclGetRecentErrMsg()
    except Exception:  # a library without the symbol, or a fault inside it: no message
        return ""
    return ffi.string(p).decode("utf-8", "replace") if p != _NULL else ""


def check(status: int, api: str) -> None:
    """Raise the AclError for a failure status of ``api``."""
    if status:
        raise errors.error_for(status, api, _recent_message())


def _null_result(api: str, status_if_no_message: int = 561103) -> errors.AclError:
    """The error for a call that signals failure by returning NULL instead of a status."""
    return errors.error_for(status_if_no_message, api, _recent_message() or f"{api} returned NULL")


def address(handle: Any) -> int:
    """The integer address of an opaque handle (0 for NULL)."""
    return int(_cast("uintptr_t", handle)) if handle is not None else 0


# ---------------------------------------------------------------------------- acl.h

def init() -> bool:
    """aclInit(NULL). True if this call initialized CANN, False if it already was (someone
    else, e.g. a framework, called aclInit in this process)."""
    st = _get().acl.aclInit(_NULL)
    if st == ACL_ERROR_REPEAT_INITIALIZE:
        _recent_message()  # consume it: not an error for us
        return False
    check(st, "aclInit")
    return True


def finalize() -> None:
    check(_get().acl.aclFinalize(), "aclFinalize")


def get_version() -> tuple[int, int, int]:
    v = _new("int32_t[]", 3)
    check(_get().acl.aclrtGetVersion(v, v + 1, v + 2), "aclrtGetVersion")
    return (v[0], v[1], v[2])


def soc_name() -> str | None:
    p = _get().acl.aclrtGetSocName()
    return ffi.string(p).decode("utf-8", "replace") if p != _NULL else None


# ---------------------------------------------------------------------------- devices

def device_count() -> int:
    n = _new("uint32_t *")
    check(_get().acl.aclrtGetDeviceCount(n), "aclrtGetDeviceCount")
    return int(n[0])


def set_device(device_id: int) -> None:
    check(_get().acl.aclrtSetDevice(device_id), "aclrtSetDevice")


def get_device() -> int:
    d = _new("int32_t *")
    check(_get().acl.aclrtGetDevice(d), "aclrtGetDevice")
    return int(d[0])




def reset_device(device_id: int) -> None:
    check(_get().acl.aclrtResetDevice(device_id), "aclrtResetDevice")


def synchronize_device() -> None:
    check(_get().acl.aclrtSynchronizeDevice(), "aclrtSynchronizeDevice")


def get_mem_info(attr: int = ACL_HBM_MEM) -> tuple[int, int]:
    free, total = _new("size_t *"), _new("size_t *")
    check(_get().acl.aclrtGetMemInfo(attr, free, total), "aclrtGetMemInfo")
    return int(free[0]), int(total[0])


# ---------------------------------------------------------------------------- streams, events

def create_stream() -> Any:
    acl = _get().acl
    p = _new("aclrtStream *")
    check(acl.aclrtCreateStream(p), "aclrtCreateStream")
    return p[0]


def destroy_stream(stream: Any) -> None:
    check(_get().acl.aclrtDestroyStream(stream), "aclrtDestroyStream")


def synchronize_stream(stream: Any, timeout_ms: int | None = None) -> None:
    acl = _get().acl
    if timeout_ms is None:
        check(acl.aclrtSynchronizeStream(stream), "aclrtSynchronizeStream")
    else:
        check(acl.aclrtSynchronizeStreamWithTimeout(stream, timeout_ms), "aclrtSynchronizeStreamWithTimeout")


def stream_wait_event(stream: Any, event: Any) -> None:
    check(_get().acl.aclrtStreamWaitEvent(stream, event), "aclrtStreamWaitEvent")


def create_event() -> Any:
    acl = _get().acl
    p = _new("aclrtEvent *")
    check(acl.aclrtCreateEvent(p), "aclrtCreateEvent")
    return p[0]


def destroy_event(event: Any) -> None:
    check(_get().acl.aclrtDestroyEvent(event), "aclrtDestroyEvent")


def record_event(event: Any, stream: Any) -> None:
    check(_get().acl.aclrtRecordEvent(event, stream), "aclrtRecordEvent")


def synchronize_event(event: Any) -> None:
    check(_get().acl.aclrtSynchronizeEvent(event), "aclrtSynchronizeEvent")


def event_elapsed_time(start: Any, end: Any) -> float:
    ms = _new("float *")
    check(_get().acl.aclrtEventElapsedTime(ms, start, end), "aclrtEventElapsedTime")
    return float(ms[0])


def null_stream() -> Any:
    """The handle that means 'the current device's default stream'."""
    return _NULL


# ---------------------------------------------------------------------------- memory

def malloc(size: int, policy: int = ACL_MEM_MALLOC_HUGE_FIRST) -> int:
    p = _new("void **")
    check(_get().acl.aclrtMalloc(p, size, policy), "aclrtMalloc")
    return int(_cast("uintptr_t", p[0]))


def free(ptr: int) -> None:
    check(_get().acl.aclrtFree(_cast_void(ptr)), "aclrtFree")


def malloc_host(size: int) -> int:
    p = _new("void **")
    check(_get().acl.aclrtMallocHost(p, size), "aclrtMallocHost")
    return int(_cast("uintptr_t", p[0]))


def free_host(ptr: int) -> None:
    check(_get().acl.aclrtFreeHost(_cast_void(ptr)), "aclrtFreeHost")


def memcpy(dst: int, dst_max: int, src: int, count: int, kind: int) -> None:
    check(
        _get().acl.aclrtMemcpy(_cast_void(dst), dst_max, _cast_void(src), count, kind),
        "aclrtMemcpy",
    )


def memcpy_async(dst: int, dst_max: int, src: int, count: int, kind: int, stream: Any) -> None:
    check(
        _get().acl.aclrtMemcpyAsync(
            _cast_void(dst), dst_max, _cast_void(src), count, kind, stream
        ),
        "aclrtMemcpyAsync",
    )


def memset(ptr: int, max_count: int, value: int, count: int) -> None:
    check(_get().acl.aclrtMemset(_cast_void(ptr), max_count, value, count), "aclrtMemset")


def memset_async(ptr: int, max_count: int, value: int, count: int, stream: Any) -> None:
    check(
        _get().acl.aclrtMemsetAsync(_cast_void(ptr), max_count, value, count, stream),
        "aclrtMemsetAsync",
    )


# ---------------------------------------------------------------------------- aclTensor

class _TensorDesc:
    """aclCreateTensor's array arguments, built once per DeviceArray and reused."""

    __slots__ = ("dims", "ndim", "dtype", "strides", "offset", "sdims", "sndim")

    def __init__(self, shape: tuple[int, ...], dtype: int, strides: tuple[int, ...], offset: int,
                 storage_shape: tuple[int, ...]) -> None:
        _get()
        self.dims = _new("int64_t[]", list(shape) or [0])
        self.ndim = len(shape)
        self.dtype = dtype
        self.strides = _new("int64_t[]", list(strides) or [0])
        self.offset = offset
        self.sdims = _new("int64_t[]", list(storage_shape) or [0])
        self.sndim = len(storage_shape)


def tensor_desc(shape: tuple[int, ...], dtype: int, strides: tuple[int, ...], offset: int,
                storage_shape: tuple[int, ...]) -> _TensorDesc:
    return _TensorDesc(shape, dtype, strides, offset, storage_shape)


def create_tensor_from_desc(desc: _TensorDesc, addr: int, fmt: int = ACL_FORMAT_ND) -> Any:
    """aclCreateTensor from a prepared description over device memory at ``addr``."""
    t = _libs.nn.aclCreateTensor(  # type: ignore[union-attr]
        desc.dims, desc.ndim, desc.dtype, desc.strides, desc.offset, fmt, desc.sdims, desc.sndim,
        _cast_void(addr),
    )
    if t == _NULL:
        raise _null_result("aclCreateTensor")
    return t




def destroy_tensor(tensor: Any) -> None:
    st = _get().nn.aclDestroyTensor(tensor)
    if st:
        check(st, "aclDestroyTensor")


def _int64_list(getter: Any, api: str, tensor: Any) -> tuple[int, ...]:
    arr, n = _new("int64_t **"), _new("uint64_t *")
    check(getter(tensor, arr, n), api)
    try:
        return tuple(int(arr[0][i]) for i in range(n[0]))
    finally:
        # CANN hands the array to the caller; the C library's free releases it.
        _libc_free(arr[0])


_libc = None


def _libc_free(ptr: Any) -> None:
    global _libc
    if _libc is None:
        _libc = ffi.dlopen(None)
    _libc.free(ptr)


def tensor_view_shape(tensor: Any) -> tuple[int, ...]:
    return _int64_list(_get().nn.aclGetViewShape, "aclGetViewShape", tensor)


def tensor_view_strides(tensor: Any) -> tuple[int, ...]:
    return _int64_list(_get().nn.aclGetViewStrides, "aclGetViewStrides", tensor)


def tensor_storage_shape(tensor: Any) -> tuple[int, ...]:
    return _int64_list(_get().nn.aclGetStorageShape, "aclGetStorageShape", tensor)


def tensor_view_offset(tensor: Any) -> int:
    v = _new("int64_t *")
    check(_get().nn.aclGetViewOffset(tensor, v), "aclGetViewOffset")
    return int(v[0])


def tensor_data_type(tensor: Any) -> int:
    nn = _get().nn
    v = _new("aclDataType *")
    check(nn.aclGetDataType(tensor, v), "aclGetDataType")
    return int(v[0])


def tensor_format(tensor: Any) -> int:
    nn = _get().nn
    v = _new("aclFormat *")
    check(nn.aclGetFormat(tensor, v), "aclGetFormat")
    return int(v[0])


def tensor_raw_addr(tensor: Any) -> int:
    v = _new("void **")
    check(_get().nn.aclGetRawTensorAddr(tensor, v), "aclGetRawTensorAddr")
    return int(_cast("uintptr_t", v[0]))


def tensor_set_raw_addr(tensor: Any, addr: int) -> None:
    check(_get().nn.aclSetRawTensorAddr(tensor, _cast_void(addr)), "aclSetRawTensorAddr")


# ---------------------------------------------------------------------------- executors

def executor_set_repeatable(executor: Any) -> None:
    check(_get().nn.aclSetAclOpExecutorRepeatable(executor), "aclSetAclOpExecutorRepeatable")


def executor_destroy(executor: Any) -> None:
    check(_get().nn.aclDestroyAclOpExecutor(executor), "aclDestroyAclOpExecutor")


def executor_set_input_addr(executor: Any, index: int, tensor: Any, addr: int) -> None:
    check(
        _get().nn.aclSetInputTensorAddr(executor, index, tensor, _cast_void(addr)),
        "aclSetInputTensorAddr",
    )


def executor_set_output_addr(executor: Any, index: int, tensor: Any, addr: int) -> None:
    check(
        _get().nn.aclSetOutputTensorAddr(executor, index, tensor, _cast_void(addr)),
        "aclSetOutputTensorAddr",
    )


# ---------------------------------------------------------------------------- the op

def moe_get_workspace_size(
    grad_expanded_x: Any, expanded_row_idx: Any, top_k: int, drop_pad_mode: int,
    active_num: int, out: Any,
) -> tuple[int, Any]:
    """aclnnMoeInitRoutingV2GradGetWorkspaceSize: (workspace bytes, executor handle)."""
    op = _get().op
    size, ex = _new("uint64_t *"), _new("aclOpExecutor **")
    check(
        op.aclnnMoeInitRoutingV2GradGetWorkspaceSize(
            grad_expanded_x or _NULL, expanded_row_idx or _NULL, top_k, drop_pad_mode,
            active_num, out or _NULL, size, ex,
        ),
        "aclnnMoeInitRoutingV2GradGetWorkspaceSize",
    )
    return int(size[0]), ex[0]


def moe_execute(workspace: int, workspace_size: int, executor: Any, stream: Any) -> None:
    """aclnnMoeInitRoutingV2Grad: queue the kernel on ``stream``."""
    st = _get().op.aclnnMoeInitRoutingV2Grad(_cast_void(workspace), workspace_size, executor, stream)
    if st:
        check(st, "aclnnMoeInitRoutingV2Grad")


def bound_launch(workspace: int, workspace_size: int, executor: Any, stream: Any) -> Any:
    """aclnnMoeInitRoutingV2Grad with every argument bound: calling it is one foreign call and
    returns the raw status (for a prepared plan's steady state; the caller checks it)."""
    fn = _get().op.aclnnMoeInitRoutingV2Grad
    ws = _cast_void(workspace)
    return functools.partial(fn, ws, workspace_size, executor, stream)


def ffi_call_probe() -> Any:
    """A bound foreign function and its argument for measuring one bare call (aclrtGetDevice):
    the unit the benchmarks express host costs in."""
    return _get().acl.aclrtGetDevice, _new("int32_t *")


# ---------------------------------------------------------------------------- emulator extras

class _EmulatorControls:
    """The aclemu* extras of the loaded emulator."""

    def __init__(self, acl: Any) -> None:
        self._acl = acl
        self._fields = [name for name, _ in _CT["aclemuStats *"].item.fields]

    def stats(self) -> dict[str, int]:
        s = _new("aclemuStats *")
        self._acl.aclemuGetStats(s)
        return {name: int(getattr(s, name)) for name in self._fields}

    def inject_fault(self, api: str, nth: int, status: int) -> None:
        if self._acl.aclemuInjectFault(api.encode(), nth, status) != 0:
            raise ValueError(f"cannot inject a fault into {api!r} at call {nth} (table full or bad argument)")

    def clear_faults(self) -> None:
        self._acl.aclemuClearFaults()

    def set_mutation(self, name: str) -> None:
        if self._acl.aclemuSetMutation(name.encode()) != 0:
            raise ValueError(f"unknown mutation {name!r}")

    def mutation(self) -> str:
        return ffi.string(self._acl.aclemuGetMutation()).decode()

    def check_guards(self) -> int:
        return int(self._acl.aclemuCheckGuards())

    def corrupt_guard(self, address: int) -> None:
        if self._acl.aclemuCorruptGuard(_cast_void(address)) != 0:
            raise ValueError(f"{address:#x} is not inside a live device allocation")

    def version(self) -> str:
        return ffi.string(self._acl.aclemuVersion()).decode()


def emulator_controls() -> _EmulatorControls:
    """The emulator's extras; RuntimeError if the process is bound to a real CANN."""
    libs = _get()
    if libs.info.backend != "emulator":
        raise RuntimeError("the loaded CANN is not the emulator; its extras are unavailable")
    return _EmulatorControls(libs.acl)
