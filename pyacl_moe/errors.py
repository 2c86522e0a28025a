"""The exceptions pyacl-moe raises.

Every status a CANN call returns is checked in one place, the bindings layer's
:func:`pyacl_moe._cann.errcheck.check`, which turns a failure, through :func:`error_for`, into
an :class:`AclError` carrying the status, its name and meaning (from the table in
:mod:`pyacl_moe._status`), the API that returned it and the vendor's own message
(``aclGetRecentErrMsg``). Op-API codes (161xxx, 361xxx, 561xxx) raise :class:`AclnnError`;
the runtime's raise :class:`AclRuntimeError`. What the binding refuses on the host, before
calling CANN, raises :class:`InvalidArgument`; using an object after it (or its device) was
closed raises :class:`ClosedError`.

This module touches no cffi object: the bindings layer hands it plain ints and strings.
"""

from __future__ import annotations

from typing import Any

from ._status import BY_NAME, TABLE

__all__ = [
    "AclError",
    "AclRuntimeError",
    "AclnnError",
    "CannNotFoundError",
    "ClosedError",
    "InvalidArgument",
    "PyaclMoeError",
    "error_for",
    "explain",
    "is_aclnn_status",
    "status_code",
    "status_name",
]


def status_name(status: int) -> str:
    """CANN's name for a status code, or 'UNKNOWN_STATUS_<n>'."""
    entry = TABLE.get(status)
    return entry[0] if entry else f"UNKNOWN_STATUS_{status}"


def status_code(name: str) -> int:
    """The status code CANN gives ``name`` (e.g. 'ACLNN_ERR_PARAM_INVALID' -> 161002)."""
    return BY_NAME[name]


def explain(status: int) -> str:
    """A one-line explanation of a status code."""
    entry = TABLE.get(status)
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

    def __reduce__(self) -> tuple[Any, ...]:
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.parameter, self.rule))


class ClosedError(PyaclMoeError, ValueError):
    """An object was used after it was closed, or after its device was closed (or, in a child
    process, after fork: CANN does not survive fork). A ValueError, as for a closed file.

    ``what`` names the object (e.g. ``"stream"``), ``reason`` says why it is closed.
    """

    def __init__(self, what: str, reason: str) -> None:
        self.what = what
        self.reason = reason
        super().__init__(f"{what} is closed: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.reason))


class CannNotFoundError(PyaclMoeError, OSError):
    """The CANN libraries were not found. ``tried`` lists every place looked at."""

    def __init__(self, tried: list[str]) -> None:
        self.tried = list(tried)
        lines = "\n".join(f"  - {t}" for t in self.tried)
        super().__init__(
            "could not load CANN (libascendcl.so, libnnopbase.so and the op's library). Tried:\n"
            f"{lines}\n"
            "Fix it either way:\n"
            "  1. on an Ascend machine, load CANN's environment first:\n"
            "       source /usr/local/Ascend/cann/set_env.sh                (8.5 and later)\n"
            "       source /usr/local/Ascend/ascend-toolkit/set_env.sh      (up to 8.3)\n"
            "     (or pass pyacl_moe.load(ascend_home='/path/to/the/cann/home'));\n"
            "  2. anywhere else, use the bundled emulator: PYACL_MOE_EMULATOR=1, "
            "pyacl_moe.use_emulator(), or 'pyacl-moe --emulator ...'."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tried,))


def error_for(status: int, api: str, message: str = "") -> AclError:
    """The exception for a failure status: AclnnError for op-API codes, else AclRuntimeError."""
    cls = AclnnError if is_aclnn_status(status) else AclRuntimeError
    return cls(status, api, message)
