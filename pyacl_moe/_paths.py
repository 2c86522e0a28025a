"""Where the package's data lives (the C declarations in headers/), whether a place may be
trusted to hold code the process loads, and how a file named from outside is read (bounded).

In a source checkout (and an editable install) headers/ sits next to the package; in a wheel
the build backend maps it to pyacl_moe/headers. Both are looked for, wheel layout first.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

HEADER_FILES: tuple[str, ...] = (
    "acl_base.h",
    "acl_rt.h",
    "acl.h",
    "acl_meta.h",
    "aclnn_moe_init_routing_v2_grad.h",
    "aclnn_moe_init_routing_v2.h",
)

_PACKAGE = Path(__file__).resolve().parent


def headers_dir() -> Path:
    """The directory holding the declaration files, in a wheel or in a source checkout."""
    for candidate in (_PACKAGE / "headers", _PACKAGE.parent / "headers"):
        if all((candidate / name).is_file() for name in HEADER_FILES):
            return candidate
    raise FileNotFoundError(
        "pyacl_moe's C declarations (headers/) are missing: looked in "
        f"{_PACKAGE / 'headers'} and {_PACKAGE.parent / 'headers'}. Reinstall the package."
    )


def untrusted(path: str | os.PathLike[str], sticky_ok: bool = False) -> str | None:
    """Why ``path`` (symbolic links followed) must not be trusted to hold code this process
    loads, or None: it must be owned by root or this user and writable by no one else (with
    ``sticky_ok``, a folder writable by others is allowed when its sticky bit keeps them from
    renaming or removing what is not theirs, as in /tmp)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror or exc})"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}, neither root nor this user (uid {os.geteuid()})"
    if st.st_mode & 0o022 and not (sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def untrusted_above(path: str | os.PathLike[str]) -> str | None:
    """:func:`untrusted` of ``path`` and of every folder above it, both as written and as its
    symbolic links resolve (whoever may replace a link or a folder on the way chooses what is
    loaded)."""
    seen: set[str] = set()
    for start in (os.path.abspath(path), os.path.realpath(path)):
        p = start
        while p not in seen:
            seen.add(p)
            why = untrusted(p)
            if why:
                return why
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
    return None


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file at ``path`` (one more than ``limit``
    says it is longer). Anything else is an OSError before a byte is read: a FIFO would block
    the read for good, a device such as /dev/zero would never end, and neither is opened so
    that it could (O_NONBLOCK)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a folder, a FIFO or a device)")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
