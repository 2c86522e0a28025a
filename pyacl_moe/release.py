"""CANN releases: their names and order, which one is loaded, and what each one's op does.

**Names.** :func:`parse_release` reads every form the vendor writes: ``8.1.RC1`` (the
toolkit's ``version=`` up to 8.3), ``8.0.RC2.alpha002`` (a pre-release of an RC), ``8.0.0``,
``9.0.0-beta.2``, ``9.0.0-rc.1``, ``9.1.0-beta.2.pre``, ``9.1.0.pre`` (the ops repositories'
tags, without their ``v``), ``9.1.0``, ``9.1.1`` and ``9.2.0-beta`` (a qualifier without a
number is its 0th, as the runtime reads it). Releases order as the vendor numbers them: at each
level alpha < beta < RC < pre < final, so 8.0.RC2.alpha002 < 8.0.RC2 < 8.0.0 < 8.1.RC1 <
9.1.0-beta.2.pre < 9.1.0-beta.2 < 9.1.0-beta.3 < 9.1.0.pre < 9.1.0. Build numbers such as
``7.7.0.1.238`` (a component's inner ``Version=`` up to 8.3) are not releases and are refused.

**Which one is loaded.** :func:`cann_version` reads it from what the install has
(:func:`read_versions`): the toolkit's release from ``<arch>-linux/ascend_toolkit_install.info``
(``version=``) or the legacy ``version.cfg`` (``runtime_running_version=[<build>:<release>]``);
from 8.5 the ops-transformer and runtime packages' from ``share/info/<package>/version.info``
(``Version=``), through the runtime's aclsysGetVersionStr when the caller provides it, or the
ops package's ``<arch>-linux/ascend_ops_install.info``; up to 8.3 the runtime's inner build
number from ``runtime/version.info``.

**What each release's op does.** :data:`BEHAVIOURS` lists where the op libraries of the
releases differ (refusal codes, strided outputs, empty tensors, the workspace), each entry
naming the vendor tag it was read from; :func:`behaviour_for` gives the entry that applies to
a release, and says so when the release is newer than every entry (the newest applies) or
older than the oldest.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ._cann.layout import arch
from ._contract import Chip, chip_named
from ._paths import read_regular

__all__ = ["BEHAVIOURS", "CHIP_RULES", "CannVersion", "OpBehaviour", "Release", "Versions", "behaviour_for",
           "cann_version", "chip_for", "parse_release", "read_versions"]

# Rank of a qualifier at one level of a release name; a level with no qualifier is final.
_RANKS = {"alpha": 0, "beta": 1, "rc": 2, "pre": 3}
_FINAL = (4, 0)
_HEAD = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?((?:[.-][A-Za-z0-9]+)*)")
_QUALIFIER = re.compile(r"(alpha|beta|rc|pre)\.?(\d*)", re.IGNORECASE)


@dataclass(frozen=True, eq=False)
class Release:
    """A parsed release name; compares in the vendor's order (see the module docstring)."""

    text: str
    major: int
    minor: int
    patch: int
    qualifiers: tuple[tuple[int, int], ...]  # (rank, number) per level, final levels omitted

    @property
    def key(self) -> tuple[int, ...]:
        levels = list(self.qualifiers) + [_FINAL] * (3 - len(self.qualifiers))
        return (self.major, self.minor, self.patch, *(x for level in levels for x in level))

    def __lt__(self, other: Release) -> bool:
        return self.key < other.key

    def __le__(self, other: Release) -> bool:
        return self.key <= other.key

    def __gt__(self, other: Release) -> bool:
        return self.key > other.key

    def __ge__(self, other: Release) -> bool:
        return self.key >= other.key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Release) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return self.text


def parse_release(text: str) -> Release:
    """The Release a version string names; ValueError naming the string when it names none."""
    if not isinstance(text, str):
        raise TypeError(f"a release name must be a str, got {type(text).__name__}")
    s = text.strip()
    if s[:1] in ("v", "V") and s[1:2].isdigit():
        s = s[1:]  # a git tag
    m = _HEAD.fullmatch(s)
    if not m:
        raise ValueError(f"{text!r} is not a CANN release name (forms: 8.1.RC1, 8.0.RC2.alpha002, 9.0.0-beta.2, "
                         "9.1.0.pre, 9.1.0)")
    tokens = [t for t in re.split(r"[.-]", m.group(4)) if t]
    qualifiers: list[tuple[int, int]] = []
    i = 0
    while i < len(tokens):
        q = _QUALIFIER.fullmatch(tokens[i])
        if not q:
            raise ValueError(f"{text!r} is not a CANN release name: {tokens[i]!r} is not a qualifier (alpha, beta, "
                             "RC or pre, with a number)")
        number = q.group(2)
        if not number and q.group(1).lower() != "pre" and i + 1 < len(tokens) and tokens[i + 1].isdigit():
            number = tokens[i + 1]  # beta.2, rc.1
            i += 1
        # A qualifier without a number counts as its 0th ("9.2.0-beta" before 9.2.0-beta.1), as
        # the runtime's aclsysGetVersionNum reads it (github:hicann/runtime 681ef7610
        # src/acl/aclrt_impl/acl.cpp:1054-1059, ParsePreNumStrict: an empty number is 0).
        qualifiers.append((_RANKS[q.group(1).lower()], int(number or 0)))
        i += 1
    if len(qualifiers) > 3:
        raise ValueError(f"{text!r} is not a CANN release name: too many qualifiers")
    patch = m.group(3)
    return Release(text.strip(), int(m.group(1)), int(m.group(2)), int(patch) if patch else 0, tuple(qualifiers))


# ---------------------------------------------------------------------------- what each release's op does

@dataclass(frozen=True)
class OpBehaviour:
    """Where the op libraries of the releases differ, for both ops of the pair.

    ``since`` is the first release known to behave so, ``source`` the vendor tag and file it
    was read from, ``inferred`` what in it was inferred rather than read."""

    since: str
    source: str
    entry: str  # "generated": the aclnnInner entry onto nnopbase; "l0op": the hand-written entry
    tiling_status: int  # a tiling refusal: 561002 ACLNN_ERR_INNER_TILING_ERROR, or 561103 from l0op
    dtype_status: int  # a data type outside the support list, non-empty tensor
    mixed_dtype_status: int  # out's data type differs from the input's (each one supported)
    empty_dtype_checked: bool  # every output empty: is an unsupported data type still refused?
    strided_out: str  # "dense": the kernel writes [N, H] densely at the view's address; "strides": through them
    workspace_aligned: bool  # the composite allocator's 512-byte alignment on top of the tiling's 16 MiB
    second_phase_checks_size: bool  # the second phase refuses a workspaceSize below the first phase's
    inferred: tuple[str, ...] = field(default=())

    @property
    def release(self) -> Release:
        return parse_release(self.since)

    @property
    def empty_dtype_status(self) -> int:
        """The first phase's status when every output is empty and an input's data type is
        unsupported."""
        return self.dtype_status if self.empty_dtype_checked else 0

    @property
    def binding_strided_out_status(self) -> int:
        """0 when the binding's checks accept a strided out (the release writes it through its
        strides), else the InvalidArgument that refuses it (161002 stands for it)."""
        return 0 if self.strided_out == "strides" else 161002

    def workspace(self, tiling: int) -> int:
        """The first phase's workspace for contiguous tensors, given the tiling's."""
        return (tiling + 32 + 511) & ~511 if self.workspace_aligned else tiling


_GENERATED = "ops-transformer {tag} moe/moe_init_routing_v2_grad/op_host/op_api/aclnn_moe_init_routing_v2_grad.cpp " \
             "(forwards to the generated aclnnInner entry) and opbase {tag} src/nnopbase/"
_L0OP = "ops-transformer {tag} moe/moe_init_routing_v2_grad/op_host/op_api/aclnn_moe_init_routing_v2_grad.cpp and " \
        "moe_init_routing_v2_grad.cpp (l0op), ops-math {tag} conversion/contiguous/op_host/op_api/contiguous.cpp " \
        "(Contiguous, ViewCopy), opbase {tag} src/nnopbase/composite_op/"

# Newest last. Releases up to 9.0.x ship the op through the entry generated onto nnopbase; the
# ops-transformer sources of v8.5.0 to v9.0.1 say so, and the 8.x releases before the
# repository existed are taken to do the same (8.1.RC1's installed header is the same
# declaration; nothing older could be read). From v9.1.0-beta.1 the entry is the l0op one.
BEHAVIOURS: tuple[OpBehaviour, ...] = (
    OpBehaviour("8.0.0", _GENERATED.format(tag="v8.5.0"), "generated", 561002, 161002, 161002, True, "dense", False,
                True, inferred=("8.0.0 to 8.3 are taken to behave as the v8.5.0 sources: no older op_api source "
                                "exists",
                                "a strided out is written densely at its view's address (nnopbase checks the "
                                "contiguity of inputs only)")),
    OpBehaviour("9.1.0-beta.1", _L0OP.format(tag="v9.1.0-beta.1"), "l0op", 561103, 561103, 561103, False, "strides",
                True, False, inferred=("the workspace: Align(16 MiB) = 16 MiB + 512 bytes, from the composite "
                                       "allocator's rounding",)),
    OpBehaviour("9.1.0-beta.2.pre", _L0OP.format(tag="v9.1.0-beta.2.pre"), "l0op", 561103, 161002, 561103, False,
                "strides", True, False, inferred=("the workspace: Align(16 MiB) = 16 MiB + 512 bytes",)),
    OpBehaviour("9.1.0.pre", _L0OP.format(tag="v9.1.0.pre"), "l0op", 561103, 161002, 161002, False, "strides", True,
                False, inferred=("the workspace: Align(16 MiB) = 16 MiB + 512 bytes",)),
)


@dataclass(frozen=True)
class Applies:
    """The behaviour that applies to a release, and why (``note`` is empty when the release is
    within the table)."""

    behaviour: OpBehaviour
    release: str | None
    note: str = ""


def behaviour_for(release: str | Release | None) -> Applies:
    """The op behaviour of ``release`` (an ops release, or the toolkit's up to 8.3). A release
    newer than every entry gets the newest and says so; one older than the oldest, or a name
    that cannot be read, gets the oldest or the newest likewise."""
    newest, oldest = BEHAVIOURS[-1], BEHAVIOURS[0]
    if release is None:
        return Applies(newest, None, f"the release is unknown: expectations of {newest.since} and later")
    text = str(release)
    try:
        r = release if isinstance(release, Release) else parse_release(release)
        unread = ""
    except ValueError:
        head = re.match(r"\d+\.\d+(?:\.\d+)?", text.strip().lstrip("vV"))
        if head is None:
            return Applies(newest, text, f"{text!r} is not a release name this version reads: expectations of "
                                         f"{newest.since} and later")
        r, unread = parse_release(head.group(0)), f"{text!r} read as {head.group(0)}: "
    if r < oldest.release:
        return Applies(oldest, text, f"{unread}{text} is older than the oldest release known ({oldest.since}): its "
                                     "expectations apply")
    applies = [b for b in BEHAVIOURS if b.release <= r][-1]
    note = unread
    if r > parse_release(NEWEST_KNOWN):
        note += f"{text} is newer than the newest release known ({NEWEST_KNOWN}): the newest's expectations apply"
    return Applies(applies, text, note.rstrip(": "))


# The newest release whose op was read. The releases after 9.1.0 (hicann/release-management
# 9.1.1/release-notes.md and 9.2.0-beta.1/, 9.2.0-beta.2/: ops-transformer tags v9.1.1,
# v9.2.0-beta.1 and v9.2.0-beta.2) are known by name and order; their notes list no change to
# either op, and their tags are in no snapshot we could read. ops-transformer's master of
# 2026-07-21 (3a280bcc3), the newest source read, changes the backward's refusal messages
# (op_host/moe_init_routing_v2_grad_tiling_base.cpp) and adds a data-movement path to the
# forward on the Ascend 950 (op_host/moe_init_routing_v2_tiling.cpp:916-933, K <= 6): no
# status, workspace, data type or result changes. So they behave as 9.1.0, and a newer release
# runs with the newest known expectations, saying so (behaviour_for).
NEWEST_KNOWN = "9.2.0-beta.2"
KNOWN_AFTER_9_1 = ("9.1.1", "9.2.0-beta.1", "9.2.0-beta.2")


# ---------------------------------------------------------------------------- chips by release

# (family, since, rules): where a family's op changed (ops-transformer
# moe/moe_init_routing_v2_grad/op_kernel/arch35/). a5d6f9dca (first in v8.5.0-beta.1) brought
# the Ascend 950's kernel, summing a token's terms one by one from +0.0; 8c1f71ff5 (first in
# v9.0.0-beta.2) sums them in fours; 49e0de82b (first in v9.1.0.pre) reads an index outside
# the rows as a zero row. The A2/A3 rules did not change. A release older than a family's
# first entry gets that entry.
CHIP_RULES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("Ascend950", "8.5.0-beta.1", {"summation": "sequential", "invalid_index": "fault"}),
    ("Ascend950", "9.0.0-beta.2", {"summation": "quads", "invalid_index": "fault"}),
    ("Ascend950", "9.1.0.pre", {"summation": "quads", "invalid_index": "zero"}),
)


def chip_for(soc: str | None, release: str | None) -> Chip:
    """The chip ``soc`` names (see :func:`pyacl_moe._contract.chip_named`) with its family's
    rules as ``release`` (an ops release) ships them; an unknown or unreadable release gets the
    newest."""
    chip = chip_named(soc, release)
    try:
        r = parse_release(release) if release else None
    except ValueError:
        r = None
    entries = [(parse_release(since), what) for family, since, what in CHIP_RULES if family == chip.family]
    if not entries or r is None:
        return chip
    applies = [what for since, what in entries if since <= r] or [entries[0][1]]
    return chip_named(soc, release, **applies[-1])


# ---------------------------------------------------------------------------- which release is loaded

@dataclass(frozen=True)
class CannVersion:
    """Which CANN the process is bound to.

    ``toolkit_version``: the toolkit release (``8.1.RC1``, ``9.0.0``); ``ops_version``: the
    ops-transformer release where it is installed apart (from 8.5), else None;
    ``runtime_version``: the runtime package's (from 8.5; up to 8.3 its inner build number);
    ``acl_version``: the ACL interface version (aclrtGetVersion); ``op_library``: the real path
    of the library the op was taken from; ``sources``: where each figure was read."""

    toolkit_version: str | None
    ops_version: str | None
    runtime_version: str | None
    acl_version: str
    op_library: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def ops_release(self) -> str | None:
        """The release the op comes from: the ops package's, else the toolkit's."""
        return self.ops_version or self.toolkit_version

    @property
    def behaviour(self) -> Applies:
        """What this release's op does where releases differ."""
        return behaviour_for(self.ops_release)

    def as_dict(self) -> dict[str, object]:
        """The figures under the keys ``pyacl-moe info --json`` and the conformance report use."""
        return {"toolkit_version": self.toolkit_version, "ops_version": self.ops_version,
                "runtime_version": self.runtime_version, "acl_version": self.acl_version,
                "op_library": self.op_library, "version_sources": dict(self.sources)}


TOOLKIT_INFO = "ascend_toolkit_install.info"
OPS_INFO = "ascend_ops_install.info"


@dataclass
class Versions:
    """What an install says of its releases; ``sources`` names the file (or call) behind each."""

    toolkit: str | None = None
    ops: str | None = None
    runtime: str | None = None
    sources: dict[str, str] = field(default_factory=dict)


MAX_INFO_FILE = 64 << 10  # bytes read of a version.info, install.info or version.cfg


def _key(path: Path, key: str) -> str | None:
    try:  # (a release file is a few lines: a longer one, a FIFO or a device is not one)
        text = read_regular(path, MAX_INFO_FILE)[:MAX_INFO_FILE].decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        k, sep, value = line.partition("=")
        if sep and k.strip() == key and value.strip():
            return value.strip().strip('"')
    return None


def _arch_dirs(home: Path) -> list[Path]:
    first = home / f"{arch()}-linux"
    return [first, *sorted(d for d in home.glob("*-linux") if d != first)]


def _version_cfg(home: Path) -> str | None:
    # "runtime_running_version=[7.7.0.1.238:8.1.RC1]": the build number, then the release.
    value = _key(home / "version.cfg", "runtime_running_version")
    m = re.fullmatch(r"\[[^:\]]*:([^\]]+)\]", value or "")
    return m.group(1) if m else None


def install_root(library_paths: Iterable[str]) -> str | None:
    """The home a library found through the dynamic loader's path belongs to: the nearest
    folder above its real path that holds a toolkit release file or ``share/info``."""
    for lib in library_paths:
        if not os.path.isabs(lib):
            continue
        p = Path(lib).resolve().parent
        for _ in range(8):
            if (p / "share" / "info").is_dir() or any((d / TOOLKIT_INFO).is_file() for d in _arch_dirs(p)):
                return str(p)
            if p.parent == p:
                break
            p = p.parent
    return None


def read_versions(home: str | None, version_str: Callable[[str], str | None] | None = None,
                  library_paths: Iterable[str] = ()) -> Versions:
    """The releases an install records. ``version_str(package)`` is the runtime's
    aclsysGetVersionStr, used only when ``$ASCEND_HOME_PATH`` is this home (it reads the
    files of that variable's home, whatever was loaded)."""
    v = Versions()
    root = home or install_root(library_paths)
    if root is None:
        return v
    h = Path(root)
    env = os.environ.get("ASCEND_HOME_PATH")
    ask = version_str if version_str and env and os.path.realpath(env) == os.path.realpath(root) else None

    def package(name: str) -> tuple[str | None, str]:
        if ask is not None:
            got = ask(name)
            if got:
                return got, f"aclsysGetVersionStr({name!r})"
        path = h / "share" / "info" / name / "version.info"
        return _key(path, "Version"), str(path)

    for d in _arch_dirs(h):
        got = _key(d / TOOLKIT_INFO, "version")
        if got:
            v.toolkit, v.sources["toolkit_version"] = got, str(d / TOOLKIT_INFO)
            break
    if v.toolkit is None:
        got = _version_cfg(h)
        if got:
            v.toolkit, v.sources["toolkit_version"] = got, str(h / "version.cfg")
    ops, where = package("ops_transformer")
    if ops is None:
        for d in _arch_dirs(h):
            ops = _key(d / OPS_INFO, "version")
            if ops:
                where = str(d / OPS_INFO)
                break
    if ops:
        v.ops, v.sources["ops_version"] = ops, where
    runtime, where = package("runtime")
    if runtime is None:
        runtime, where = _key(h / "runtime" / "version.info", "Version"), str(h / "runtime" / "version.info")
    if runtime:
        v.runtime, v.sources["runtime_version"] = runtime, where
    return v


_cached: list[CannVersion] = []  # the loaded CANN's, read once (an install does not change under us)


def cann_version() -> CannVersion:
    """The loaded CANN's releases (loading CANN if needed); read once per process."""
    if _cached:
        return _cached[0]
    from ._cann import acl, loader

    info = loader.library_info()
    found = read_versions(info.home, acl.version_str if acl.has_version_str() else None)
    major, minor, patch = acl.get_version()
    v = CannVersion(found.toolkit, found.ops, found.runtime, f"{major}.{minor}.{patch}", info.op_library,
                    dict(found.sources))
    _cached.append(v)
    return v
