"""Status codes and exceptions.

Every status a CANN call returns is checked by the bindings layer (``_ffi.check``), which turns
a failure, through :func:`error_for`, into an :class:`AclError` carrying the status, its name
from the table below, the API that returned it and the vendor's own message
(``aclGetRecentErrMsg``). Op-API codes (161xxx, 361xxx, 561xxx) raise :class:`AclnnError`;
the runtime's raise :class:`AclRuntimeError`. What the binding refuses on the host, before
calling CANN, raises :class:`InvalidArgument`.

This module touches no cffi object: the loader hands it plain ints and strings.
"""

from __future__ import annotations

# code -> (name, what it means). Names and values are CANN 8.x's; the explanations are ours.
_TABLE: dict[int, tuple[str, str]] = {
    0: ("ACL_SUCCESS", "success"),
    # acl: general
    100000: ("ACL_ERROR_INVALID_PARAM", "a parameter is invalid (often a null pointer or a size)"),
    100001: ("ACL_ERROR_UNINITIALIZE", "aclInit has not been called"),
    100002: ("ACL_ERROR_REPEAT_INITIALIZE", "aclInit was already called in this process"),
    100003: ("ACL_ERROR_INVALID_FILE", "invalid file"),
    100004: ("ACL_ERROR_WRITE_FILE", "writing a file failed"),
    100005: ("ACL_ERROR_INVALID_FILE_SIZE", "invalid file size"),
    100006: ("ACL_ERROR_PARSE_FILE", "parsing a file failed"),
    100007: ("ACL_ERROR_FILE_MISSING_ATTR", "a file lacks an attribute"),
    100008: ("ACL_ERROR_FILE_ATTR_INVALID", "a file attribute is invalid"),
    100009: ("ACL_ERROR_INVALID_DUMP_CONFIG", "invalid dump configuration"),
    100010: ("ACL_ERROR_INVALID_PROFILING_CONFIG", "invalid profiling configuration"),
    100011: ("ACL_ERROR_INVALID_MODEL_ID", "invalid model id"),
    100012: ("ACL_ERROR_DESERIALIZE_MODEL", "deserializing a model failed"),
    100013: ("ACL_ERROR_PARSE_MODEL", "parsing a model failed"),
    100014: ("ACL_ERROR_READ_MODEL_FAILURE", "reading a model failed"),
    100015: ("ACL_ERROR_MODEL_SIZE_INVALID", "invalid model size"),
    100016: ("ACL_ERROR_MODEL_MISSING_ATTR", "a model lacks an attribute"),
    100017: ("ACL_ERROR_MODEL_INPUT_NOT_MATCH", "model inputs do not match"),
    100018: ("ACL_ERROR_MODEL_OUTPUT_NOT_MATCH", "model outputs do not match"),
    100019: ("ACL_ERROR_MODEL_NOT_DYNAMIC", "the model is not dynamic"),
    100020: ("ACL_ERROR_OP_TYPE_NOT_MATCH", "operator type does not match"),
    100021: ("ACL_ERROR_OP_INPUT_NOT_MATCH", "operator inputs do not match"),
    100022: ("ACL_ERROR_OP_OUTPUT_NOT_MATCH", "operator outputs do not match"),
    100023: ("ACL_ERROR_OP_ATTR_NOT_MATCH", "operator attributes do not match"),
    100024: ("ACL_ERROR_OP_NOT_FOUND", "operator not found"),
    100025: ("ACL_ERROR_OP_LOAD_FAILED", "loading an operator failed"),
    100026: ("ACL_ERROR_UNSUPPORTED_DATA_TYPE", "unsupported data type"),
    100027: ("ACL_ERROR_FORMAT_NOT_MATCH", "format does not match"),
    100028: ("ACL_ERROR_BIN_SELECTOR_NOT_REGISTERED", "binary selector not registered"),
    100029: ("ACL_ERROR_KERNEL_NOT_FOUND", "kernel not found"),
    100030: ("ACL_ERROR_BIN_SELECTOR_ALREADY_REGISTERED", "binary selector already registered"),
    100031: ("ACL_ERROR_KERNEL_ALREADY_REGISTERED", "kernel already registered"),
    100032: ("ACL_ERROR_INVALID_QUEUE_ID", "invalid queue id"),
    100033: ("ACL_ERROR_REPEAT_SUBSCRIBE", "already subscribed"),
    100034: ("ACL_ERROR_STREAM_NOT_SUBSCRIBE", "stream not subscribed"),
    100035: ("ACL_ERROR_THREAD_NOT_SUBSCRIBE", "thread not subscribed"),
    100036: ("ACL_ERROR_WAIT_CALLBACK_TIMEOUT", "waiting for a callback timed out"),
    100037: ("ACL_ERROR_REPEAT_FINALIZE", "aclFinalize was already called"),
    100038: ("ACL_ERROR_NOT_STATIC_AIPP", "not a static AIPP configuration"),
    100039: ("ACL_ERROR_COMPILING_STUB_MODE", "compiling stub mode"),
    100040: ("ACL_ERROR_GROUP_NOT_SET", "group not set"),
    100041: ("ACL_ERROR_GROUP_NOT_CREATE", "group not created"),
    100042: ("ACL_ERROR_PROF_ALREADY_RUN", "profiling already running"),
    100043: ("ACL_ERROR_PROF_NOT_RUN", "profiling not running"),
    100044: ("ACL_ERROR_DUMP_ALREADY_RUN", "dump already running"),
    100045: ("ACL_ERROR_DUMP_NOT_RUN", "dump not running"),
    148046: ("ACL_ERROR_PROF_REPEAT_SUBSCRIBE", "profiling already subscribed"),
    148047: ("ACL_ERROR_PROF_API_CONFLICT", "conflicting profiling APIs"),
    148048: ("ACL_ERROR_INVALID_MAX_OPQUEUE_NUM_CONFIG", "invalid op queue configuration"),
    148049: ("ACL_ERROR_INVALID_OPP_PATH", "invalid operator package path (ASCEND_OPP_PATH)"),
    148050: ("ACL_ERROR_OP_UNSUPPORTED_DYNAMIC", "operator does not support dynamic shapes"),
    148051: ("ACL_ERROR_RELATIVE_RESOURCE_NOT_CLEARED", "related resources not released"),
    148052: ("ACL_ERROR_UNSUPPORTED_JPEG", "unsupported JPEG"),
    148053: ("ACL_ERROR_INVALID_BUNDLE_MODEL_ID", "invalid bundle model id"),
    200000: ("ACL_ERROR_BAD_ALLOC", "host memory allocation failed"),
    200001: ("ACL_ERROR_API_NOT_SUPPORT", "API not supported"),
    200002: ("ACL_ERROR_INVALID_DEVICE", "invalid device"),
    200003: ("ACL_ERROR_MEMORY_ADDRESS_UNALIGNED", "memory address not aligned"),
    200004: ("ACL_ERROR_RESOURCE_NOT_MATCH", "resources do not match"),
    200005: ("ACL_ERROR_INVALID_RESOURCE_HANDLE", "invalid resource handle"),
    200006: ("ACL_ERROR_FEATURE_UNSUPPORTED", "feature not supported"),
    200007: ("ACL_ERROR_PROF_MODULES_UNSUPPORTED", "profiling modules not supported"),
    300000: ("ACL_ERROR_STORAGE_OVER_LIMIT", "storage over limit"),
    500000: ("ACL_ERROR_INTERNAL_ERROR", "internal error"),
    500001: ("ACL_ERROR_FAILURE", "failure"),
    500002: ("ACL_ERROR_GE_FAILURE", "graph engine failure"),
    500003: ("ACL_ERROR_RT_FAILURE", "runtime failure"),
    500004: ("ACL_ERROR_DRV_FAILURE", "driver failure"),
    500005: ("ACL_ERROR_PROFILING_FAILURE", "profiling failure"),
    # runtime: parameters and state
    107000: ("ACL_ERROR_RT_PARAM_INVALID", "a runtime parameter is invalid (e.g. an address outside device memory)"),
    107001: ("ACL_ERROR_RT_INVALID_DEVICEID", "invalid device id"),
    107002: ("ACL_ERROR_RT_CONTEXT_NULL", "no current context: aclrtSetDevice was not called on this thread"),
    107003: ("ACL_ERROR_RT_STREAM_CONTEXT", "the stream does not belong to the current device"),
    107004: ("ACL_ERROR_RT_MODEL_CONTEXT", "the model does not belong to the current context"),
    107005: ("ACL_ERROR_RT_STREAM_MODEL", "the stream is not in the model"),
    107006: ("ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID", "the event has no timestamp (never recorded)"),
    107007: ("ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL", "the end event completed before the start event"),
    107008: ("ACL_ERROR_RT_ADDR_UNALIGNED", "address not aligned"),
    107009: ("ACL_ERROR_RT_FILE_OPEN", "opening a file failed"),
    107010: ("ACL_ERROR_RT_FILE_WRITE", "writing a file failed"),
    107011: ("ACL_ERROR_RT_STREAM_SUBSCRIBE", "stream subscription error"),
    107012: ("ACL_ERROR_RT_THREAD_SUBSCRIBE", "thread subscription error"),
    107013: ("ACL_ERROR_RT_GROUP_NOT_SET", "group not set"),
    107014: ("ACL_ERROR_RT_GROUP_NOT_CREATE", "group not created"),
    107015: ("ACL_ERROR_RT_STREAM_NO_CB_REG", "no callback registered on the stream"),
    107016: ("ACL_ERROR_RT_INVALID_MEMORY_TYPE", "invalid memory type"),
    107017: ("ACL_ERROR_RT_INVALID_HANDLE", "invalid handle (destroyed or never created)"),
    107018: ("ACL_ERROR_RT_INVALID_MALLOC_TYPE", "invalid allocation type"),
    107019: ("ACL_ERROR_RT_WAIT_TIMEOUT", "wait timed out"),
    107020: ("ACL_ERROR_RT_TASK_TIMEOUT", "task timed out"),
    107021: ("ACL_ERROR_RT_SYSPARAMOPT_NOT_SET", "system parameter option not set"),
    107022: ("ACL_ERROR_RT_DEVICE_TASK_ABORT", "device tasks aborting"),
    107023: ("ACL_ERROR_RT_STREAM_ABORT", "stream aborting"),
    107024: ("ACL_ERROR_RT_CAPTURE_DEPENDENCY", "capture dependency failure"),
    107025: ("ACL_ERROR_RT_STREAM_UNJOINED", "invalid capture model"),
    107026: ("ACL_ERROR_RT_MODEL_CAPTURED", "model is captured"),
    107027: ("ACL_ERROR_RT_STREAM_CAPTURED", "stream is captured"),
    107028: ("ACL_ERROR_RT_EVENT_CAPTURED", "event is captured"),
    107029: ("ACL_ERROR_RT_STREAM_NOT_CAPTURED", "stream is not being captured"),
    107030: ("ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT", "not supported while capturing"),
    107031: ("ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT", "implicit dependency on the default stream while capturing"),
    107032: ("ACL_ERROR_STREAM_CAPTURE_CONFLICT", "interdependent streams cannot start capture together"),
    107033: ("ACL_ERROR_STREAM_TASK_GROUP_STATUS", "task group status error"),
    107034: ("ACL_ERROR_STREAM_TASK_GROUP_INTR", "task group interrupted"),
    # runtime: resources
    207000: ("ACL_ERROR_RT_FEATURE_NOT_SUPPORT", "feature not supported"),
    207001: ("ACL_ERROR_RT_MEMORY_ALLOCATION", "device memory allocation failed (out of device memory?)"),
    207002: ("ACL_ERROR_RT_MEMORY_FREE", "freeing device memory failed (not a live allocation?)"),
    207003: ("ACL_ERROR_RT_AICORE_OVER_FLOW", "AI Core overflow"),
    207004: ("ACL_ERROR_RT_NO_DEVICE", "no device"),
    207005: ("ACL_ERROR_RT_RESOURCE_ALLOC_FAIL", "resource allocation failed"),
    207006: ("ACL_ERROR_RT_NO_PERMISSION", "no permission"),
    207007: ("ACL_ERROR_RT_NO_EVENT_RESOURCE", "no event resource left"),
    207008: ("ACL_ERROR_RT_NO_STREAM_RESOURCE", "no stream resource left"),
    207009: ("ACL_ERROR_RT_NO_NOTIFY_RESOURCE", "no notify resource left"),
    207010: ("ACL_ERROR_RT_NO_MODEL_RESOURCE", "no model resource left"),
    207011: ("ACL_ERROR_RT_NO_CDQ_RESOURCE", "no CDQ resource left"),
    207012: ("ACL_ERROR_RT_OVER_LIMIT", "over limit"),
    207013: ("ACL_ERROR_RT_QUEUE_EMPTY", "queue empty"),
    207014: ("ACL_ERROR_RT_QUEUE_FULL", "queue full"),
    207015: ("ACL_ERROR_RT_REPEATED_INIT", "repeated initialization"),
    207016: ("ACL_ERROR_RT_AIVEC_OVER_FLOW", "AI Vector overflow"),
    207017: ("ACL_ERROR_RT_OVER_FLOW", "overflow"),
    207018: ("ACL_ERROR_RT_DEVICE_OOM", "device out of memory"),
    # runtime: device and task failures
    507000: ("ACL_ERROR_RT_INTERNAL_ERROR", "runtime internal error"),
    507001: ("ACL_ERROR_RT_TS_ERROR", "task scheduler error"),
    507002: ("ACL_ERROR_RT_STREAM_TASK_FULL", "stream task queue full"),
    507003: ("ACL_ERROR_RT_STREAM_TASK_EMPTY", "stream task queue empty"),
    507004: ("ACL_ERROR_RT_STREAM_NOT_COMPLETE", "stream not complete"),
    507005: ("ACL_ERROR_RT_END_OF_SEQUENCE", "end of sequence"),
    507006: ("ACL_ERROR_RT_EVENT_NOT_COMPLETE", "event not complete: synchronize it first"),
    507007: ("ACL_ERROR_RT_CONTEXT_RELEASE_ERROR", "context release error"),
    507008: ("ACL_ERROR_RT_SOC_VERSION", "SoC version error"),
    507009: ("ACL_ERROR_RT_TASK_TYPE_NOT_SUPPORT", "task type not supported"),
    507010: ("ACL_ERROR_RT_LOST_HEARTBEAT", "task scheduler lost heartbeat"),
    507011: ("ACL_ERROR_RT_MODEL_EXECUTE", "model execution failed"),
    507012: ("ACL_ERROR_RT_REPORT_TIMEOUT", "report timed out"),
    507013: ("ACL_ERROR_RT_SYS_DMA", "DMA error (a copy touched memory it should not)"),
    507014: ("ACL_ERROR_RT_AICORE_TIMEOUT", "AI Core timed out"),
    507015: ("ACL_ERROR_RT_AICORE_EXCEPTION",
             "AI Core exception: a kernel faulted on the device (often an out-of-range index)"),
    507016: ("ACL_ERROR_RT_AICORE_TRAP_EXCEPTION", "AI Core trap exception"),
    507017: ("ACL_ERROR_RT_AICPU_TIMEOUT", "AI CPU timed out"),
    507018: ("ACL_ERROR_RT_AICPU_EXCEPTION", "AI CPU exception"),
    507019: ("ACL_ERROR_RT_AICPU_DATADUMP_RSP_ERR", "AI CPU data dump response error"),
    507020: ("ACL_ERROR_RT_AICPU_MODEL_RSP_ERR", "AI CPU model response error"),
    507021: ("ACL_ERROR_RT_PROFILING_ERROR", "profiling error"),
    507022: ("ACL_ERROR_RT_IPC_ERROR", "IPC error"),
    507023: ("ACL_ERROR_RT_MODEL_ABORT_NORMAL", "model aborted"),
    507024: ("ACL_ERROR_RT_KERNEL_UNREGISTERING", "kernel unregistering"),
    507025: ("ACL_ERROR_RT_RINGBUFFER_NOT_INIT", "ring buffer not initialized"),
    507026: ("ACL_ERROR_RT_RINGBUFFER_NO_DATA", "ring buffer empty"),
    507027: ("ACL_ERROR_RT_KERNEL_LOOKUP", "kernel lookup error"),
    507028: ("ACL_ERROR_RT_KERNEL_DUPLICATE", "kernel registered twice"),
    507029: ("ACL_ERROR_RT_DEBUG_REGISTER_FAIL", "debug registration failed"),
    507030: ("ACL_ERROR_RT_DEBUG_UNREGISTER_FAIL", "debug unregistration failed"),
    507031: ("ACL_ERROR_RT_LABEL_CONTEXT", "label not in the current context"),
    507032: ("ACL_ERROR_RT_PROGRAM_USE_OUT", "program registrations exhausted"),
    507033: ("ACL_ERROR_RT_DEV_SETUP_ERROR", "device setup error"),
    507034: ("ACL_ERROR_RT_VECTOR_CORE_TIMEOUT", "vector core timed out"),
    507035: ("ACL_ERROR_RT_VECTOR_CORE_EXCEPTION", "vector core exception"),
    507036: ("ACL_ERROR_RT_VECTOR_CORE_TRAP_EXCEPTION", "vector core trap exception"),
    507037: ("ACL_ERROR_RT_CDQ_BATCH_ABNORMAL", "CDQ batch allocation abnormal"),
    507038: ("ACL_ERROR_RT_DIE_MODE_CHANGE_ERROR", "die mode cannot change"),
    507039: ("ACL_ERROR_RT_DIE_SET_ERROR", "single-die mode cannot set a die"),
    507040: ("ACL_ERROR_RT_INVALID_DIEID", "invalid die id"),
    507041: ("ACL_ERROR_RT_DIE_MODE_NOT_SET", "die mode not set"),
    507042: ("ACL_ERROR_RT_AICORE_TRAP_READ_OVERFLOW", "AI Core trap: read overflow"),
    507043: ("ACL_ERROR_RT_AICORE_TRAP_WRITE_OVERFLOW", "AI Core trap: write overflow"),
    507044: ("ACL_ERROR_RT_VECTOR_CORE_TRAP_READ_OVERFLOW", "vector core trap: read overflow"),
    507045: ("ACL_ERROR_RT_VECTOR_CORE_TRAP_WRITE_OVERFLOW", "vector core trap: write overflow"),
    507046: ("ACL_ERROR_RT_STREAM_SYNC_TIMEOUT", "stream synchronization timed out"),
    507047: ("ACL_ERROR_RT_EVENT_SYNC_TIMEOUT", "event synchronization timed out"),
    507048: ("ACL_ERROR_RT_FFTS_PLUS_TIMEOUT", "FFTS+ timed out"),
    507049: ("ACL_ERROR_RT_FFTS_PLUS_EXCEPTION", "FFTS+ exception"),
    507050: ("ACL_ERROR_RT_FFTS_PLUS_TRAP_EXCEPTION", "FFTS+ trap exception"),
    507051: ("ACL_ERROR_RT_SEND_MSG", "sending a message to the device failed"),
    507052: ("ACL_ERROR_RT_COPY_DATA", "copying data failed"),
    507053: ("ACL_ERROR_RT_DEVICE_MEM_ERROR",
             "device memory error (e.g. corrupted guard bytes: something wrote past a block)"),
    507054: ("ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR", "HBM multi-bit ECC error"),
    507899: ("ACL_ERROR_RT_DRV_INTERNAL_ERROR", "driver internal error"),
    507900: ("ACL_ERROR_RT_AICPU_INTERNAL_ERROR", "AI CPU internal error"),
    507901: ("ACL_ERROR_RT_SOCKET_CLOSE", "host-device connection closed"),
    507902: ("ACL_ERROR_RT_AICPU_INFO_LOAD_RSP_ERR", "AI CPU info load response error"),
    507903: ("ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED", "capture invalidated"),
    # aclnn (op API)
    161001: ("ACLNN_ERR_PARAM_NULLPTR", "a required tensor or output pointer is null"),
    161002: ("ACLNN_ERR_PARAM_INVALID", "a parameter is invalid (data type, format, layout or handle)"),
    361001: ("ACLNN_ERR_RUNTIME_ERROR", "a runtime call inside the op API failed"),
    561000: ("ACLNN_ERR_INNER", "op API internal error"),
    561001: ("ACLNN_ERR_INNER_INFERSHAPE_ERROR", "shape inference failed"),
    561002: ("ACLNN_ERR_INNER_TILING_ERROR", "tiling rejected the shapes or attributes"),
    561003: ("ACLNN_ERR_INNER_FIND_KERNEL_ERROR", "no kernel for this case (operator package missing?)"),
    561101: ("ACLNN_ERR_INNER_CREATE_EXECUTOR", "creating the executor failed"),
    561102: ("ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR", "executor not transferred"),
    561103: ("ACLNN_ERR_INNER_NULLPTR", "internal null pointer"),
    561104: ("ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE", "wrong attribute info size"),
    561105: ("ACLNN_ERR_INNER_KEY_CONFILICT", "key conflict"),
    561106: ("ACLNN_ERR_INNER_INVALID_IMPL_MODE", "invalid implementation mode"),
    561107: ("ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND", "operator package path not found (ASCEND_OPP_PATH)"),
    561108: ("ACLNN_ERR_INNER_LOAD_JSON_FAILED", "loading a kernel description failed"),
    561109: ("ACLNN_ERR_INNER_JSON_VALUE_NOT_FOUND", "kernel description lacks a value"),
    561110: ("ACLNN_ERR_INNER_JSON_FORMAT_INVALID", "kernel description has an invalid format"),
    561111: ("ACLNN_ERR_INNER_JSON_DTYPE_INVALID", "kernel description has an invalid data type"),
    561112: ("ACLNN_ERR_INNER_OPP_KERNEL_PKG_NOT_FOUND", "operator kernel package not installed"),
    561113: ("ACLNN_ERR_INNER_OP_FILE_INVALID", "invalid operator file"),
    561114: ("ACLNN_ERR_INNER_ATTR_NUM_OUT_OF_BOUND", "too many attributes"),
    561115: ("ACLNN_ERR_INNER_ATTR_LEN_NOT_ENOUGH", "attribute too short"),
    561116: ("ACLNN_ERR_INNER_INPUT_NUM_IN_JSON_TOO_LARGE", "too many inputs in the kernel description"),
    561117: ("ACLNN_ERR_INNER_INPUT_JSON_IS_NULL", "empty kernel description"),
    561118: ("ACLNN_ERR_INNER_STATIC_WORKSPACE_INVALID", "invalid static workspace"),
    561119: ("ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID", "invalid static block dimension"),
}

_BY_NAME: dict[str, int] = {name: code for code, (name, _) in _TABLE.items()}


def status_name(status: int) -> str:
    """CANN's name for a status code, or 'UNKNOWN_STATUS_<n>'."""
    entry = _TABLE.get(status)
    return entry[0] if entry else f"UNKNOWN_STATUS_{status}"


def status_code(name: str) -> int:
    """The status code CANN gives ``name`` (e.g. 'ACLNN_ERR_PARAM_INVALID' -> 161002)."""
    return _BY_NAME[name]


def explain(status: int) -> str:
    """A one-line explanation of a status code."""
    entry = _TABLE.get(status)
    return entry[1] if entry else "status not in pyacl-moe's table"


def is_aclnn_status(status: int) -> bool:
    """Whether a status comes from the op API (161xxx, 361xxx, 561xxx)."""
    return status // 1000 in (161, 361, 561)


class PyaclMoeError(Exception):
    """Base of every error this package raises on purpose."""


class AclError(PyaclMoeError, RuntimeError):
    """A CANN call returned a failure status.

    Attributes: ``status`` (int), ``name`` (CANN's name for it), ``api`` (the function that
    returned it) and ``message`` (CANN's own text from aclGetRecentErrMsg, possibly empty).
    """

    def __init__(self, status: int, api: str, message: str = "") -> None:
        self.status = int(status)
        self.name = status_name(self.status)
        self.api = api
        self.message = message.strip()
        text = f"{api} failed with {self.status} {self.name}: {explain(self.status)}"
        if self.message:
            text += f"\n  CANN says: {self.message}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.status, self.api, self.message))


class AclnnError(AclError):
    """A failure status from the op API (aclnn*, 161xxx/361xxx/561xxx)."""


class AclRuntimeError(AclError):
    """A failure status from the runtime (acl*/aclrt*: 1xxxxx, 2xxxxx, 5xxxxx)."""


class InvalidArgument(PyaclMoeError, ValueError):
    """The binding refused an argument on the host, before calling CANN.

    ``parameter`` names the argument, ``rule`` states what it must satisfy.
    """

    def __init__(self, parameter: str, rule: str) -> None:
        self.parameter = parameter
        self.rule = rule
        super().__init__(f"{parameter}: {rule}")

    def __reduce__(self):
        return (type(self), (self.parameter, self.rule))


class CannNotFoundError(PyaclMoeError, OSError):
    """The CANN libraries were not found. ``tried`` lists every place looked at."""

    def __init__(self, tried: list[str]) -> None:
        self.tried = list(tried)
        lines = "\n".join(f"  - {t}" for t in self.tried)
        super().__init__(
            "could not load CANN (libascendcl.so, libnnopbase.so, libopapi.so). Tried:\n"
            f"{lines}\n"
            "Fix it either way:\n"
            "  1. on an Ascend machine, load the toolkit environment first:\n"
            "       source /usr/local/Ascend/ascend-toolkit/set_env.sh\n"
            "     (or pass pyacl_moe.load(ascend_home='/path/to/ascend-toolkit/latest'));\n"
            "  2. anywhere else, use the bundled emulator: PYACL_MOE_EMULATOR=1, "
            "pyacl_moe.use_emulator(), or 'pyacl-moe --emulator ...'."
        )

    def __reduce__(self):
        return (type(self), (self.tried,))


def error_for(status: int, api: str, message: str = "") -> AclError:
    """The exception for a failure status: AclnnError for op-API codes, else AclRuntimeError."""
    cls = AclnnError if is_aclnn_status(status) else AclRuntimeError
    return cls(status, api, message)

