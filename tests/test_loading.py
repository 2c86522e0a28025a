"""Library discovery and loading (issue: the cffi binding). Each case runs in a fresh
interpreter, because what a process loads is process-wide and final."""

from __future__ import annotations

import json

import pytest

from pyacl_moe import emulator

PRELUDE = """
import json, os, sys
import pyacl_moe as pm
"""


@pytest.fixture(scope="module")
def emu_home():
    return emulator.build()


def _clean_env(**extra):
    env = {"PYACL_MOE_EMULATOR": "", "ASCEND_HOME_PATH": "", "ASCEND_TOOLKIT_HOME": "", "LD_LIBRARY_PATH": ""}
    env.update(extra)
    return env


def test_import_loads_nothing(isolated):
    r = isolated(PRELUDE + """
assert pm.loaded_info() is None
maps = open('/proc/self/maps').read()
assert 'libascendcl' not in maps and 'libopapi' not in maps, 'a CANN library was mapped at import'
print('ok')
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_not_found_lists_every_place_and_both_fixes(isolated, tmp_path):
    r = isolated(PRELUDE + """
try:
    pm.device_count()
except pm.CannNotFoundError as e:
    print(json.dumps({'tried': e.tried, 'text': str(e)}))
else:
    sys.exit('loaded something')
""", env=_clean_env(ASCEND_HOME_PATH=str(tmp_path / "nowhere"), ASCEND_TOOLKIT_HOME=str(tmp_path / "also-nowhere")))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tried = "\n".join(out["tried"])
    assert "$ASCEND_HOME_PATH" in tried and str(tmp_path / "nowhere") in tried
    assert "$ASCEND_TOOLKIT_HOME" in tried and "also-nowhere" in tried
    assert "/usr/local/Ascend/ascend-toolkit/latest" in tried
    assert "dynamic loader" in tried
    assert "set_env.sh" in out["text"] and "PYACL_MOE_EMULATOR=1" in out["text"]


def test_ascend_home_path_is_searched_like_a_cann_install(isolated, emu_home):
    # The emulator home is laid out like a CANN install, so the normal search finds it.
    r = isolated(PRELUDE + """
info = pm.library_info()
print(json.dumps({'backend': info.backend, 'home': info.home, 'paths': info.paths, 'n': pm.device_count()}))
""", env=_clean_env(ASCEND_HOME_PATH=emu_home))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == "cann" and out["home"] == emu_home and out["n"] == 1
    assert out["paths"]["opapi"] == f"{emu_home}/lib64/libopapi.so"


def test_home_path_takes_precedence_over_toolkit_home(isolated, emu_home, tmp_path):
    r = isolated(PRELUDE + "print(pm.library_info().home)",
                 env=_clean_env(ASCEND_HOME_PATH=str(tmp_path), ASCEND_TOOLKIT_HOME=emu_home))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == emu_home  # the empty ASCEND_HOME_PATH was tried and skipped


def test_explicit_home_wins_and_bad_explicit_home_is_an_error(isolated, emu_home, tmp_path):
    r = isolated(PRELUDE + f"print(pm.load(ascend_home={emu_home!r}).home)",
                 env=_clean_env(ASCEND_HOME_PATH=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == emu_home
    r = isolated(PRELUDE + f"""
try:
    pm.load(ascend_home={str(tmp_path)!r})
except pm.CannNotFoundError as e:
    print('ascend_home' in e.tried[0])
""", env=_clean_env(ASCEND_HOME_PATH=emu_home))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_dynamic_loader_path_is_the_last_resort(isolated, emu_home):
    # No home anywhere: libascendcl.so is found by the loader through LD_LIBRARY_PATH, which
    # the loader reads at process start, hence the variable in the child's environment.
    r = isolated(PRELUDE + "i = pm.library_info(); print(i.home, i.paths['ascendcl'])",
                 env=_clean_env(LD_LIBRARY_PATH=f"{emu_home}/lib64"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "libascendcl.so"]


def test_emulator_selected_by_env_and_function(isolated):
    r = isolated(PRELUDE + "print(pm.library_info().backend)", env=_clean_env(PYACL_MOE_EMULATOR="1"))
    assert r.stdout.strip() == "emulator", r.stderr
    r = isolated(PRELUDE + "pm.use_emulator(); print(pm.library_info().backend)", env=_clean_env())
    assert r.stdout.strip() == "emulator", r.stderr


def test_use_emulator_after_cann_loaded_is_refused(isolated, emu_home):
    r = isolated(PRELUDE + """
pm.library_info()
try:
    pm.use_emulator()
except RuntimeError as e:
    print('refused')
""", env=_clean_env(ASCEND_HOME_PATH=emu_home))
    assert r.stdout.strip() == "refused", r.stderr


def test_concurrent_first_use_loads_once(isolated):
    r = isolated(PRELUDE + """
import threading
from pyacl_moe import _ffi
calls = []
orig = _ffi._dlopen_home
def counting(*a, **k):
    calls.append(1)
    return orig(*a, **k)
_ffi._dlopen_home = counting
infos = []
ts = [threading.Thread(target=lambda: infos.append(pm.library_info())) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
print(len(calls), len(set(id(i) for i in infos)))
""", env=_clean_env(PYACL_MOE_EMULATOR="1"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"]
