"""Checks against a real CANN.

The header check needs only CANN's headers: $PYACL_MOE_CANN_INCLUDE, or
$ASCEND_HOME_PATH/include, or /usr/local/Ascend/ascend-toolkit/latest/include (for the op's
header, also $PYACL_MOE_CANN_OP_INCLUDE or <include>/aclnnop). The sample check needs those
headers, a C++ compiler and a checkout of the vendor's ops-transformer repository
($PYACL_MOE_OPS_TRANSFORMER), whose samples it builds against the emulator. Tests marked
``cann`` need a device: run them with PYACL_MOE_TEST_BACKEND=cann.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyacl_moe import _paths

ROOT = Path(__file__).resolve().parent.parent

# Our file -> where CANN keeps the header it mirrors, relative to the include directory.
MIRRORS = {
    "acl_base.h": ["acl/acl_base.h", "acl/error_codes/rt_error_codes.h"],
    "acl_rt.h": ["acl/acl_rt.h"],
    "acl.h": ["acl/acl.h"],
    "acl_meta.h": ["aclnn/acl_meta.h"],
    "aclnn_moe_init_routing_v2_grad.h": ["aclnnop/aclnn_moe_init_routing_v2_grad.h"],
    "aclnn_moe_init_routing_v2.h": ["aclnnop/aclnn_moe_init_routing_v2.h"],
}


def _include_dirs() -> tuple[Path, Path] | None:
    candidates = [os.environ.get("PYACL_MOE_CANN_INCLUDE")]
    home = os.environ.get("ASCEND_HOME_PATH")
    if home:
        candidates.append(os.path.join(home, "include"))
    candidates.append("/usr/local/Ascend/ascend-toolkit/latest/include")
    for c in candidates:
        if c and (Path(c) / "acl" / "acl_rt.h").is_file():
            op = Path(os.environ.get("PYACL_MOE_CANN_OP_INCLUDE") or Path(c) / "aclnnop")
            return Path(c), op
    return None


def _prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types without names), from C or C++ header text."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = text.replace("ACL_FUNC_VISIBILITY", "").replace('__attribute__((visibility("default")))', "")
    out = {}
    for m in re.finditer(r"([A-Za-z_][\w \*]*?)\b(acl\w+)\s*\(([^;{]*?)\)\s*;", text, re.S):
        ret, name, params = (re.sub(r"\s+", " ", g).strip() for g in m.groups())
        items = [] if params in ("", "void") else [p.strip() for p in params.split(",")]
        types = [re.sub(r"\s*\b\w+$", "", p).replace(" *", "*").replace("const size_t", "size_t") for p in items]
        out[name] = (ret.split()[-1] if ret else "", types)
    return out


def _constants(text: str) -> dict[str, int]:
    """Explicit values (=, #define) and implicit enum positions, as ints."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    number = r"(-?(?:0x)?[0-9A-Fa-f]+[uU]?)\b"
    out = {k: int(v.rstrip("uU"), 0) for k, v in re.findall(r"#define\s+(ACL_[A-Z0-9_]+)\s+" + number, text)}
    out.update({k: int(v.rstrip("uU"), 0) for k, v in re.findall(r"\b(ACL_[A-Z0-9_]+)\s*=\s*" + number, text)})
    for body in re.findall(r"enum\s*\w*\s*\{(.*?)\}", text, re.S):
        value = -1
        for item in body.split(","):
            item = item.strip()
            if not item:
                continue
            name, _, explicit = item.partition("=")
            value = int(explicit.strip().rstrip("uU"), 0) if explicit.strip() else value + 1
            out[name.strip()] = value
    return out


def test_headers_match_the_installed_cann():
    dirs = _include_dirs()
    if dirs is None:
        pytest.skip("no CANN headers found (set PYACL_MOE_CANN_INCLUDE or ASCEND_HOME_PATH)")
    include, op_include = dirs
    problems, compared = [], 0
    for ours, theirs in MIRRORS.items():
        vendor_text = ""
        for rel in theirs:
            path = (op_include / Path(rel).name) if rel.startswith("aclnnop/") else include / rel
            if not path.is_file():
                pytest.skip(f"{path} not found")
            vendor_text += path.read_text(errors="replace")
        our_text = (_paths.headers_dir() / ours).read_text()
        vp, op = _prototypes(vendor_text), _prototypes(our_text)
        for name, sig in op.items():
            compared += 1
            if vp.get(name) != sig:
                problems.append(f"{ours}: {name}: ours {sig}, CANN {vp.get(name)}")
        vc, oc = _constants(vendor_text), _constants(our_text)
        for name, value in oc.items():
            if name in vc and vc[name] != value:
                problems.append(f"{ours}: {name} = {value}, CANN has {vc[name]}")
            elif name not in vc and not name.startswith("ACL_ERROR") and name != "ACL_RT_SUCCESS":
                problems.append(f"{ours}: {name} not in CANN's header")
    assert compared >= 49
    assert not problems, "\n".join(problems)


# What each of the vendor's published samples (ops-transformer, moe/<op>/examples/) must print,
# by name: the values its own data gives by the op's formulas. The backward adds rows 2 and 0
# of [[0.1, 0.1], [0.3, 0.3], [0.2, 0.2], [0.4, 0.4]] for token 0 and rows 1 and 3 for token 1;
# the forward routes 3 tokens of 0.1, 0.2 and 0.3 to experts [[1, 2], [0, 1], [0, 2]] with
# capacity 2 (docs/emulator.md, "The forward op").
SAMPLES = {
    "moe_init_routing_v2_grad": {"gradXData": [0.3, 0.3, 0.7, 0.7]},
    "moe_init_routing_v2": {
        "expandedXData": [v for v in (0.2, 0.3, 0.1, 0.2, 0.1, 0.3) for _ in range(4)],
        "expandedRowIdxData": [2, 4, 0, 3, 1, 5],
        "expertTokenIdxData": [2, 2, 2],
    },
}


@pytest.mark.parametrize("op", list(SAMPLES))
def test_vendor_sample_builds_against_cann_headers_and_runs_on_the_emulator(op, tmp_path):
    """The sample, unmodified, compiled against CANN's headers only and linked to the
    emulator's libraries, prints the documented values."""
    dirs = _include_dirs()
    repo = os.environ.get("PYACL_MOE_OPS_TRANSFORMER")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if dirs is None or not repo or not compiler:
        pytest.skip("needs CANN's headers, PYACL_MOE_OPS_TRANSFORMER (a checkout of ops-transformer) and a C++ "
                    "compiler")
    include, op_include = dirs
    source = Path(repo) / "moe" / op / "examples" / f"test_aclnn_{op}.cpp"
    if not source.is_file() or not (op_include / f"aclnn_{op}.h").is_file():
        pytest.skip(f"{source} or {op_include / f'aclnn_{op}.h'} not found")
    from pyacl_moe import emulator

    lib64 = Path(emulator.build()) / "lib64"
    exe = tmp_path / "sample"
    build = subprocess.run([compiler, "-std=c++14", str(source), "-I", str(include), "-I", str(op_include.parent),
                            "-L", str(lib64), "-lascendcl", "-lnnopbase", "-lopapi", f"-Wl,-rpath,{lib64}",
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    printed: dict[str, list[float]] = {}
    for name, index, value in re.findall(r"^(\w+)\[(\d+)\] is: (\S+)$", run.stdout, re.M):
        assert int(index) == len(printed.setdefault(name, []))
        printed[name].append(float(value))
    assert printed.keys() == SAMPLES[op].keys(), run.stdout
    for name, want in SAMPLES[op].items():
        assert printed[name] == pytest.approx(want, abs=1e-6), name


@pytest.mark.cann
def test_quickstart_runs_on_cann():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                       timeout=600, env={k: v for k, v in os.environ.items() if k != "PYACL_MOE_EMULATOR"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend: cann" in r.stdout


@pytest.mark.cann
def test_conformance_quick_on_cann():
    from pyacl_moe.tools import conformance

    report = conformance.run("quick", progress=None)
    assert report.ok, report.table()
