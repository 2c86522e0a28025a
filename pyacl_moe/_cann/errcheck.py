"""The one status check: every CANN status goes through :func:`check`."""

from __future__ import annotations

from .. import errors
from . import declare, loader

__all__ = ["check", "null_result", "recent_message"]


def recent_message() -> str:
    """CANN's text for the calling thread's latest failure (aclGetRecentErrMsg), or ''. Only
    called after a call into the loaded libraries (every status checked comes from one)."""
    return declare.text(loader.libs().acl.aclGetRecentErrMsg())  # (every library loaded has it: the loader resolved it)


def check(status: int, api: str) -> None:
    """Raise the AclError for a failure status of ``api`` (nothing for 0)."""
    if status:
        raise errors.error_for(status, api, recent_message())


def null_result(api: str) -> errors.AclError:
    """The error for a call that signals failure by returning NULL instead of a status: 561103
    (ACLNN_ERR_INNER_NULLPTR), with CANN's message or, lacking one, what returned NULL."""
    return errors.error_for(561103, api, recent_message() or f"{api} returned NULL")
