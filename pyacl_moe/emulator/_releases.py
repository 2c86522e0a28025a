"""The CANN releases the emulator can stand for, and how each one lays out its install.

``PYACL_MOE_EMU_RELEASE`` picks one (:data:`DEFAULT` when unset): every build makes the install
tree of each profile, and ``build()`` returns the home of the selected one, which the binding
then searches and loads exactly as it would a CANN of that release. Each profile's
libascendcl.so links its own ``release.c`` (the release code and the ACL interface version);
the op libraries ask it where the releases' op entries differ.

Two layouts (docs/emulator.md, *Releases*, says what each follows and what is inferred):

- ``toolkit`` (up to 8.3: 8.0.0, 8.1.RC1): ``Ascend/ascend-toolkit/<release>/`` with
  ``<arch>-linux/lib64/{libascendcl,libnnopbase}.so``, the all-in-one op library in
  ``opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/<arch>/libopapi.so`` linked from lib64,
  ``lib64 -> <arch>-linux/lib64``, ``<arch>-linux/ascend_toolkit_install.info``; beside it
  ``latest/`` (its home: links into the release folder, and ``version.cfg``) and
  ``set_env.sh``.
- ``cann`` (8.5 and later): ``Ascend/cann-<release>/`` (its home; ``Ascend/cann`` links to it)
  with ``<arch>-linux/lib64/{libascendcl,libnnopbase,libopapi_math,libopapi_transformer}.so``
  (no libopapi.so), ``lib64 -> <arch>-linux/lib64``, ``share/info/<package>/version.info``, the
  toolkit's and the ops package's install-info files and ``set_env.sh``.

Plain Python: neither imports cffi nor loads anything.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT", "PROFILES", "RELEASE_ENV", "SHORT_NAMES", "LinkedLibrary", "Profile", "canonical", "home",
           "lay_out", "libraries", "link", "make_folders", "selected"]

RELEASE_ENV = "PYACL_MOE_EMU_RELEASE"

# The sources of each library, by the role it plays.
RUNTIME = ("rt_state.c", "rt_device.c", "rt_stream.c", "rt_memory.c")
NNOPBASE = ("nnopbase.c",)
OPS_MATH = ("opapi_math.c",)
OPS_TRANSFORMER = ("opapi.c", "kernel.c", "opapi_fwd.c", "kernel_fwd.c")
RELEASE_SOURCE = "release.c"
OP_API = "opp/built-in/op_impl/ai_core/tbe/op_api/lib/linux/{arch}"


@dataclass(frozen=True)
class Profile:
    """One emulated release. ``code`` is major * 10000 + minor * 100 + patch (what
    aclemuRelease() returns; 8.1.RC1 is 80100); ``acl_version`` what aclrtGetVersion reports
    (the release's acl headers' ACL_*_VERSION); ``inner`` the toolkit's ``innerversion=`` and
    ``build`` a component's inner ``Version=`` up to 8.3, where they are known (None: not
    written); ``follows`` the vendor sources its op follows."""

    release: str
    code: int
    acl_version: tuple[int, int, int]
    layout: str
    inner: str | None
    build: str | None
    follows: str


PROFILES: dict[str, Profile] = {p.release: p for p in (
    Profile("8.0.0", 80000, (1, 12, 0), "toolkit", "V100R001C20SPC001B251", None,
            "the 8.1.RC1 model (no 8.0 op source exists); 8.0's layout and names"),
    Profile("8.1.RC1", 80100, (1, 13, 0), "toolkit", "V100R001C21SPC001B238", "7.7.0.1.238",
            "the 8.1.RC1 headers and install tree (leideng/CANN-8.1.RC1); op rules from ops-transformer v8.5.0"),
    Profile("8.5.0", 80500, (1, 16, 0), "cann", "V100R001C25SPC001B212", None,
            "ops-transformer, opbase, ops-math and runtime v8.5.0"),
    Profile("9.0.0", 90000, (1, 17, 0), "cann", None, None, "ops-transformer, opbase, ops-math and runtime v9.0.0"),
    Profile("9.1.0", 90100, (1, 17, 0), "cann", None, None,
            "ops-transformer and opbase v9.1.0.pre (no v9.1.0 tag), ops-math and runtime v9.1.0"),
)}

# The newest release the vendor published a tag table for (hicann/release-management
# 9.0.0/release-notes.md): its layout is today's (the cann root, the per-repository library
# and its libopapi_math.so), and its op's entry is the one 8.1.RC1 has (the generated entry
# onto nnopbase, unchanged from ops-transformer v8.5.0 to v9.0.1), whose every rule the tests
# were first checked against. 9.1.0 follows pre-release tags only.
DEFAULT = "9.0.0"


# The names the README and CANN's own notes give a release line ("9.1"): each is the one release
# of that line the emulator stands for. (9.1.1 exists as a CANN release, and the binding knows
# it, but the emulator's 9.1 is 9.1.0.)
SHORT_NAMES: dict[str, str] = {".".join(name.split(".")[:2]): name for name in PROFILES}


def canonical(name: str) -> str | None:
    """The emulated release ``name`` stands for (a release of PROFILES, or its line as
    SHORT_NAMES gives it: "9.1" is "9.1.0"); None for any other name."""
    return name if name in PROFILES else SHORT_NAMES.get(name)


def selected(environ: os._Environ[str] | dict[str, str] | None = None) -> Profile:
    """The profile ``PYACL_MOE_EMU_RELEASE`` names (checked by _env.check_environment)."""
    env = os.environ if environ is None else environ
    return PROFILES[canonical(env.get(RELEASE_ENV, "").strip()) or DEFAULT]


def arch() -> str:
    m = platform.machine()
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(m, m) or "unknown"


@dataclass(frozen=True)
class LinkedLibrary:
    """A library a profile links: its file (relative to the tree), sources, the libraries it
    needs (by name), and the links to it (relative paths of symbolic links)."""

    name: str
    path: str
    sources: tuple[str, ...]
    needs: tuple[str, ...]
    links: tuple[str, ...] = ()


def release_folder(p: Profile) -> str:
    """The folder of a profile's release under the tree's root (``Ascend/...``)."""
    return f"Ascend/ascend-toolkit/{p.release}" if p.layout == "toolkit" else f"Ascend/cann-{p.release}"


def home(p: Profile) -> str:
    """A profile's home relative to the tree: what its set_env.sh exports as ASCEND_HOME_PATH."""
    return "Ascend/ascend-toolkit/latest" if p.layout == "toolkit" else release_folder(p)


def libraries(p: Profile) -> list[LinkedLibrary]:
    """What a profile links, in link order (each needs only the ones before it)."""
    base = release_folder(p)
    lib64 = f"{base}/{arch()}-linux/lib64"
    runtime = [LinkedLibrary("ascendcl", f"{lib64}/libascendcl.so", RUNTIME + (RELEASE_SOURCE,), ()),
               LinkedLibrary("nnopbase", f"{lib64}/libnnopbase.so", NNOPBASE, ("ascendcl",))]
    if p.layout == "toolkit":
        op_api = f"{base}/{OP_API.format(arch=arch())}"
        return runtime + [LinkedLibrary("opapi", f"{op_api}/libopapi.so", OPS_MATH + OPS_TRANSFORMER,
                                        ("nnopbase", "ascendcl"), (f"{lib64}/libopapi.so",))]
    return runtime + [
        LinkedLibrary("opapi_math", f"{lib64}/libopapi_math.so", OPS_MATH, ("nnopbase", "ascendcl")),
        LinkedLibrary("opapi_transformer", f"{lib64}/libopapi_transformer.so", OPS_TRANSFORMER,
                      ("opapi_math", "nnopbase", "ascendcl")),
    ]


def make_folders(path: Path) -> None:
    """``path`` and the folders above it, each private (mkdir's mode applies to the last only)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        p.mkdir(mode=0o700)


def link(tree: Path, link: str, target: str) -> None:
    """A relative symbolic link at ``link`` to ``target`` (both relative to the tree)."""
    where = tree / link
    make_folders(where.parent)
    os.symlink(os.path.relpath(tree / target, where.parent), where)


def _write(tree: Path, rel: str, lines: list[str]) -> None:
    path = tree / rel
    make_folders(path.parent)
    path.write_text("\n".join(lines) + "\n")


_SET_ENV = """\
# The environment of this emulated CANN {release} install, as the release's set_env.sh sets it
# (its home computed from this file's own place). Written by pyacl-moe's emulator builder.
_here="$(cd "$(dirname "${{BASH_SOURCE[0]:-$0}}")" && pwd -P)"
export ASCEND_TOOLKIT_HOME="$_here{home_suffix}"
export ASCEND_HOME_PATH="$ASCEND_TOOLKIT_HOME"
export ASCEND_OPP_PATH="$ASCEND_TOOLKIT_HOME/opp"
export ASCEND_AICPU_PATH="$ASCEND_TOOLKIT_HOME"
export TOOLCHAIN_HOME="$ASCEND_TOOLKIT_HOME/toolkit"
export LD_LIBRARY_PATH="$ASCEND_TOOLKIT_HOME/lib64${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
unset _here
"""


def lay_out(p: Profile, tree: Path, final_tree: Path) -> None:
    """Everything of a profile's install but its libraries and their links, which the builder
    makes first: folder links, release and version files, set_env.sh.
    ``final_tree`` is where ``tree`` will be once renamed into place (for the path= lines)."""
    base, a = release_folder(p), arch()
    link(tree, f"{base}/lib64", f"{base}/{a}-linux/lib64")
    toolkit_info = ["package_name=Ascend-cann-toolkit", f"version={p.release}"]
    if p.inner:
        toolkit_info.append(f"innerversion={p.inner}")
    toolkit_info += [f"arch={a}", "os=linux", f"path={final_tree / base / f'{a}-linux'}"]
    _write(tree, f"{base}/{a}-linux/ascend_toolkit_install.info", toolkit_info)
    if p.layout == "toolkit":
        root = "Ascend/ascend-toolkit"
        if p.build:
            _write(tree, f"{base}/runtime/version.info", [f"Version={p.build}", f"version_dir={p.release}"])
            _write(tree, f"{base}/opp/version.info", [f"Version={p.build}", f"version_dir={p.release}"])
        # latest/ is a folder of links into the release's (8.1.RC1's links each file; a link
        # per folder answers every lookup the same way) and keeps version.cfg.
        for part in (f"{a}-linux", "opp", "runtime"):
            if (tree / base / part).exists():
                link(tree, f"{root}/latest/{part}", f"{base}/{part}")
        link(tree, f"{root}/latest/lib64", f"{root}/latest/{a}-linux/lib64")
        build = p.build or p.release
        _write(tree, f"{root}/latest/version.cfg", ["# version: 1.0"] + [
            f"{c}_{kind}_version=[{build}:{p.release}]" for c in ("runtime", "compiler", "opp", "toolkit")
            for kind in ("running", "upgrade", "installed")])
        (tree / root / "set_env.sh").write_text(_SET_ENV.format(release=p.release, home_suffix="/latest"))
        return
    _write(tree, f"{base}/{a}-linux/ascend_ops_install.info", [
        "package_name=Ascend-cann-910b-ops", f"version={p.release}", f"arch={a}", "os=linux",
        f"path={final_tree / base / f'{a}-linux'}"])
    for package in ("runtime", "opbase", "ops_math", "ops_transformer"):
        _write(tree, f"{base}/share/info/{package}/version.info", [f"Version={p.release}", "version_dir=cann"])
    (tree / base / "set_env.sh").write_text(_SET_ENV.format(release=p.release, home_suffix=""))
    link(tree, f"{base}/{a}-linux/bin/setenv.bash", f"{base}/set_env.sh")
    link(tree, "Ascend/cann", base)
