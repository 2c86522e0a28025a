"""The bindings layer (pyacl_moe._cann): library discovery and loading, providers, layering.

Each loading case runs in a fresh interpreter, because what a process loads is process-wide
and final."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

import pyacl_moe as pm
from pyacl_moe import emulator
from pyacl_moe._cann import loader

from . import children

PACKAGE = Path(__file__).resolve().parent.parent / "pyacl_moe"

@pytest.fixture(scope="module")
def emu_home():
    return emulator.build()


def _clean_env(**extra):
    env = {"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": "", "ASCEND_TOOLKIT_HOME": "", "LD_LIBRARY_PATH": ""}
    env.update(extra)
    return env


def child_not_found() -> None:
    try:
        pm.device_count()
    except pm.CannNotFoundError as e:
        result = {"tried": e.tried, "text": str(e)}
    else:
        sys.exit("loaded something")
    # A failed search binds the process to nothing: the emulator can still be chosen.
    result["after"] = [pm.loaded_info(), pm.load(emulator=True).backend, pm.library_info().backend]
    print(json.dumps(result))


def test_not_found_lists_every_place_and_both_fixes(isolated, tmp_path):
    r = isolated(child_not_found, env=_clean_env(ASCEND_HOME_PATH=str(tmp_path / "nowhere"),
                                          ASCEND_TOOLKIT_HOME=str(tmp_path / "also-nowhere")))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tried = "\n".join(out["tried"])
    assert "$ASCEND_HOME_PATH" in tried and str(tmp_path / "nowhere") in tried
    assert "$ASCEND_TOOLKIT_HOME" in tried and "also-nowhere" in tried
    assert "/usr/local/Ascend/ascend-toolkit/latest" in tried
    assert "dynamic loader" in tried
    assert "set_env.sh" in out["text"] and "PYACL_MOE_EMULATOR=1" in out["text"]
    assert out["after"] == [None, "emulator", "emulator"]


def child_bad_explicit_home_then_the_search(bad_home: str) -> None:
    try:
        pm.load(ascend_home=bad_home)
    except pm.CannNotFoundError as e:
        assert "ascend_home" in e.tried[0] and len(e.tried) == 1, e.tried
    else:
        sys.exit("a bad explicit home loaded something")
    info = pm.library_info()
    print(json.dumps({"backend": info.backend, "home": info.home, "op": info.op_library, "n": pm.device_count()}))


def test_ascend_home_path_is_searched_like_a_cann_install(isolated, emu_home, tmp_path):
    # The emulator home is laid out like a CANN install, so the normal search finds it. A bad
    # explicit home is an error (and binds nothing): it is not searched past.
    r = isolated(child_bad_explicit_home_then_the_search, str(tmp_path), env=_clean_env(ASCEND_HOME_PATH=emu_home))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "cann" and out["home"] == emu_home and out["n"] == 1
    assert out["op"] == os.path.realpath(dict(emulator.library_paths())["op"])


def child_print_home() -> None:
    print(pm.library_info().home)


def test_home_path_takes_precedence_over_toolkit_home(isolated, emu_home, tmp_path):
    r = isolated(child_print_home,
                 env=_clean_env(ASCEND_HOME_PATH=str(tmp_path), ASCEND_TOOLKIT_HOME=emu_home))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == emu_home  # the empty ASCEND_HOME_PATH was tried and skipped


def child_print_explicit_home(home: str) -> None:
    print(pm.load(ascend_home=home).home)


def test_explicit_home_wins(isolated, emu_home, tmp_path):
    r = isolated(child_print_explicit_home, emu_home, env=_clean_env(ASCEND_HOME_PATH=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == emu_home


def child_print_home_and_ascendcl() -> None:
    i = pm.library_info()
    print(i.home, i.paths["ascendcl"])


def test_dynamic_loader_path_is_the_last_resort(isolated, emu_home):
    # No home anywhere: libascendcl.so is found by the loader through LD_LIBRARY_PATH, which
    # the loader reads at process start, hence the variable in the child's environment.
    r = isolated(child_print_home_and_ascendcl, env=_clean_env(LD_LIBRARY_PATH=f"{emu_home}/lib64"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "libascendcl.so"]


def child_use_emulator() -> None:
    pm.use_emulator()
    print(pm.library_info().backend)


def test_emulator_selected_by_function(isolated):
    # (by the environment: see test_import_loads_nothing_and_concurrent_first_use_loads_once)
    r = isolated(child_use_emulator, env=_clean_env())
    assert r.stdout.strip() == "emulator", r.stderr


def child_use_emulator_after_cann_loaded() -> None:
    pm.Device(0)
    for switch in (pm.use_emulator, lambda: pm.load(emulator=True)):
        try:
            switch()
        except RuntimeError:
            print("refused")
    pm.load()  # the same choice again: a no-op
    print(pm.library_info().backend)
    for extra in (pm.emulator.stats, pm.emulator.check_guards, lambda: pm.emulator.set_stream_mode("lazy")):
        try:
            extra()
        except RuntimeError as e:
            print("unavailable" if "not the emulator" in str(e) else repr(e))


def test_use_emulator_after_cann_loaded_is_refused(isolated, emu_home):
    # The emulator's libraries found as a CANN install: the process is bound to "cann", which
    # is final, and the emulator's extras are not available on it.
    r = isolated(child_use_emulator_after_cann_loaded, env=_clean_env(ASCEND_HOME_PATH=emu_home))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "refused", "cann"] + ["unavailable"] * 3


def child_emulator_imported_twice() -> None:
    import importlib

    importlib.import_module("pyacl_moe.emulator")  # (adds the emulator's declarations)
    del sys.modules["pyacl_moe.emulator"]  # as an import that failed after them leaves it
    pm.__dict__.pop("emulator", None)
    print(pm.load(emulator=True).backend, pm.emulator.stats()["streams"])


def test_the_emulator_loads_after_its_package_was_imported_twice(isolated):
    """The emulator's package declares its extras when it is imported: a second import (a
    reload, or an import that failed after the declarations) gave cdef the same struct again,
    and the emulator could not be loaded in that process (CDefError)."""
    r = isolated(child_emulator_imported_twice, env=_clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["emulator", "0"], r.stdout


def child_registered_providers(empty_home: str, emu_home: str) -> None:
    loader.register_provider(loader.Provider(name="empty", home=lambda: empty_home))
    loader.select_provider("empty")
    try:
        pm.library_info()
    except pm.CannNotFoundError as e:
        print("libascendcl.so: not found" in str(e), pm.loaded_info())
    loader.register_provider(loader.Provider(name="mine", home=lambda: emu_home))
    loader.register_provider(loader.Provider(name="mine", home=lambda: "/nowhere"))
    try:
        loader.select_provider("nobody")
    except RuntimeError as e:
        print("unknown" if "'mine'" in str(e) else repr(e))
    loader.select_provider("mine")
    info = pm.library_info()
    print(info.backend, info.home == emu_home, pm.device_count())
    try:
        loader.select_provider("emulator")
    except RuntimeError:
        print("final")


def test_a_registered_provider_is_selected_by_name(isolated, emu_home, tmp_path):
    # Any other home of the three libraries can register; the first registration of a name
    # stands, an unknown name is refused, a provider missing a library is reported (and binds
    # nothing), and a provider is loaded from its home.
    (tmp_path / "lib64").mkdir()
    r = isolated(child_registered_providers, str(tmp_path), emu_home, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "None", "unknown", "mine", "True", "1", "final"]


def test_import_loads_nothing_and_concurrent_first_use_loads_once(isolated):
    # The child is in tests/children.py: this module imports the emulator, which the child
    # checks the package's import did not.
    r = isolated(children.child_import_loads_nothing_then_one_load, env=_clean_env(PYACL_MOE_EMULATOR="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "8", "1", "True", "emulator"]


def test_constants_are_read_from_the_headers():
    from pyacl_moe._cann import declare

    assert declare.const("ACL_FORMAT_ND") == 2
    assert declare.const("ACL_FLOAT16") == 1 and declare.const("ACL_BF16") == 27
    assert declare.const("ACL_MEMCPY_HOST_TO_DEVICE") == 1 and declare.const("ACL_MEMCPY_DEVICE_TO_HOST") == 2
    assert declare.const("ACL_ERROR_REPEAT_INITIALIZE") == 100002
    with pytest.raises(AttributeError):
        declare.const("ACL_NO_SUCH_CONSTANT")
    names = [f for h in declare.HEADER_FILES for f in declare.functions_in(h)]
    for api in ("aclInit", "aclrtSetCurrentContext", "aclrtQueryEventStatus", "aclrtStreamQuery",
                "aclnnMoeInitRoutingV2GradGetWorkspaceSize", "aclnnMoeInitRoutingV2Grad"):
        assert api in names


# ---------------------------------------------------------------------------------- layering

def _imports(path: Path) -> set[str]:
    """Every module a source file imports, relative imports resolved against the package."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)[:-1]  # the package the file is in (for __init__ too)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def test_only_the_bindings_layer_touches_cffi():
    sources = [p for p in PACKAGE.rglob("*.py") if "_cann" not in p.relative_to(PACKAGE).parts]
    assert len(sources) > 15
    users = sorted(str(p.relative_to(PACKAGE)) for p in sources if any(m.split(".")[0] == "cffi" for m in _imports(p)))
    assert not users, f"cffi used outside pyacl_moe._cann: {users}"
    inside = [p for p in (PACKAGE / "_cann").glob("*.py") if "cffi" in {m.split(".")[0] for m in _imports(p)}]
    assert [p.name for p in inside] == ["declare.py"]  # the one FFI object


def test_the_bindings_layer_imports_nothing_above_it():
    allowed = ("pyacl_moe._cann", "pyacl_moe.errors", "pyacl_moe._paths", "pyacl_moe._status")
    for p in (PACKAGE / "_cann").glob("*.py"):
        ours = {m for m in _imports(p) if m.startswith("pyacl_moe")}
        above = sorted(m for m in ours if not m.startswith(allowed) and m != "pyacl_moe")
        assert not above, f"{p.name} imports {above}"


def test_load_refuses_bad_arguments():
    import pyacl_moe as pm

    with pytest.raises(pm.InvalidArgument, match="ascend_home"):
        pm.load(ascend_home=3)
    with pytest.raises(pm.InvalidArgument, match="emulator"):
        pm.load(emulator="yes")
