"""Where the package's data lives: the C declarations in headers/.

In a source checkout (and an editable install) headers/ sits next to the package; in a wheel
the build backend maps it to pyacl_moe/headers. Both are looked for, wheel layout first.
"""

from __future__ import annotations

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
