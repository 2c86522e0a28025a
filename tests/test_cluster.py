"""Conformance across a cluster: --shard, merge, ASCEND_RT_VISIBLE_DEVICES, and --ray (a real
two-node local Ray cluster in the slow step; without Ray, the failure paths through a stand-in)."""

from __future__ import annotations

import copy
import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import pyacl_moe as pm
from pyacl_moe import cli
from pyacl_moe.tools import cluster, conformance, kitcases, visible

from .conftest import ROOT, run_isolated, start_isolated
from .test_conformance_kit import BACKWARD_ROWS, FORWARD_ROWS, _write

JUNIT_XSD = Path(__file__).resolve().parent / "data" / "junit.xsd"


def _cli(*args: str, capsys) -> tuple[int, str, str]:
    """cli.main in this process; a refusal argparse makes itself (SystemExit) counts too."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------- --shard

@pytest.mark.parametrize("profile", ["quick", "full", "cases"])
def test_shards_cover_the_selection_exactly_once_and_stay_the_same(profile, tmp_path):
    if profile == "cases":
        sel = kitcases.load([_write(tmp_path / "g.csv", BACKWARD_ROWS), _write(tmp_path / "f.csv", FORWARD_ROWS)])
    else:
        sel = conformance.select(profile)
    order = {c.name: i for i, c in enumerate(sel)}
    for n in range(1, 6):
        parts = [conformance.shard(sel, i, n) for i in range(1, n + 1)]
        names = [c.name for part in parts for c in part]
        assert sorted(names) == sorted(order) and len(names) == len(set(names)), n
        assert all(parts) if len(sel) >= n else True
        assert all([order[c.name] for c in part] == sorted(order[c.name] for c in part) for part in parts)
        again = [[c.name for c in conformance.shard(sel, i, n)] for i in range(1, n + 1)]
        assert again == [[c.name for c in part] for part in parts]
        if n > 1 and profile != "cases":  # the large cases are spread, not dealt to one part
            sizes = [sum(c.nbytes for c in part) for part in parts]
            assert max(sizes) - min(sizes) <= max(c.nbytes for c in sel) + (1 << 20) * len(sel)


def test_a_shard_does_not_depend_on_the_seed_or_the_catalogue_order_of_runs():
    sel = conformance.select("quick")
    # A case's size (what the parts are balanced by) is computed without its inputs.
    assert [c.name for c in conformance.shard(sel, 2, 3)] == [c.name for c in conformance.shard(list(sel), 2, 3)]


@pytest.mark.parametrize("index, count", [(0, 3), (4, 3), (1, 0), (True, 2), (1.0, 2)])
def test_shard_refuses_a_part_outside_its_count(index, count):
    with pytest.raises(ValueError, match=r"^shard: the (part|count)"):
        conformance.shard(conformance.select("quick"), index, count)


@pytest.mark.parametrize("value", ["0/3", "4/3", "1/0", "a/b", "3", "1/2/3", "-1/2", " 1/2", "1/99999999999"])
def test_the_shard_flag_refuses_bad_values_in_one_line(value, capsys):
    code, out, err = _cli("--emulator", "conformance", f"--shard={value}", capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "argument --shard:" in err and "1 <= I <= N" in err, err


def test_more_parts_than_cases_is_refused_naming_the_flag(capsys):
    code, _, err = _cli("--emulator", "conformance", "--filter=dropless-float32-tiny", "--shard=1/2", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "argument --shard: 1/2: 1 case(s) are selected" in err, err


def test_list_shows_the_part(capsys):
    code, out, _ = _cli("--emulator", "conformance", "--list", "--filter=-tiny", "--shard=2/3", capsys=capsys)
    want = [c.name for c in conformance.shard(conformance.select("quick", "-tiny"), 2, 3)]
    assert code == 0 and out.splitlines()[-1] == f"{len(want)} cases"
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == want


def _verdicts(cases) -> dict[str, tuple[str, str | None]]:
    return {c["name"]: (c["outcome"], c.get("digest")) for c in cases}


def _parts_merge_to_the_whole(tmp_path, name_filter, counts):
    pm.emulator.set_mutation("fp16-accumulate")  # some cases fail: the verdicts are not all the same
    whole = conformance.run("quick", name_filter, progress=None)
    want = _verdicts(c.as_dict() for c in whole.cases)
    assert {o for o, _ in want.values()} >= {"pass", "fail"}
    for n in counts:
        paths = []
        for i in range(1, n + 1):
            part = conformance.run("quick", name_filter, progress=None, part=(i, n))
            assert part.shard == {"index": i, "count": n} and part.selection == whole.selection
            paths.append(str(tmp_path / f"part-{i}-of-{n}.json"))
            part.write_json(paths[-1])
        merged = cluster.merge([(p, cluster.read_report(p)) for p in paths])
        assert _verdicts(merged["cases"]) == want, n
        assert merged["exit_status"] == 1 and merged["missing"] == 0 and len(merged["hosts"]) == 1
        if n > 1:  # a part left out: its cases are in no report, and the merge says so
            short = cluster.merge([(p, cluster.read_report(p)) for p in paths[1:]])
            assert short["exit_status"] == 2 and short["missing"] == len(conformance.shard(
                conformance.select("quick", name_filter), 1, n))


def test_merged_parts_give_the_unsharded_verdict_case_by_case(device, clean_emulator, tmp_path):
    _parts_merge_to_the_whole(tmp_path, "-float32-", (2, 3))


@pytest.mark.slow
def test_merged_parts_of_the_whole_catalogue_give_its_verdict_for_1_to_5_parts(device, clean_emulator, tmp_path):
    _parts_merge_to_the_whole(tmp_path, None, range(1, 6))


# ---------------------------------------------------------------------------- merge

@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Reports of a few cases: as the emulator computes them, and under a wrong kernel."""
    folder = tmp_path_factory.mktemp("reports")
    pm.Device(0)
    good = conformance.run("quick", "-tiny", progress=None).as_dict()
    pm.emulator.set_mutation("fp16-accumulate")
    try:
        bad = conformance.run("quick", "-tiny", progress=None).as_dict()
    finally:
        pm.emulator.set_mutation(None)
    return folder, good, bad


def _save(folder, name, data) -> str:
    path = folder / name
    path.write_text(json.dumps(data))
    return str(path)


def _host(report, host, devices=(0,), physical=None):
    r = copy.deepcopy(report)
    r["host"], r["devices"] = host, list(devices)
    r["physical_devices"] = list(physical if physical is not None else devices)
    for c in r["cases"]:
        c["device"] = devices[0]
    return r


def test_merge_names_the_hosts_their_devices_and_the_odd_host(reports, capsys):
    folder, good, bad = reports
    a = _save(folder, "a.json", _host(good, "host-a", (0,), (5,)))
    b = _save(folder, "b.json", _host(bad, "host-b", (0,), (3,)))
    out_json, out_xml = str(folder / "cluster.json"), str(folder / "cluster.xml")
    code, out, err = _cli("merge", a, b, "--report", out_json, "--junit", out_xml, capsys=capsys)
    assert code == 1, err
    merged = json.loads(Path(out_json).read_text())
    hosts = {h["host"]: h for h in merged["hosts"]}
    assert set(hosts) == {"host-a", "host-b"}
    assert [d["device"] for d in hosts["host-a"]["devices"]] == [5] and hosts["host-a"]["ok"]
    assert [d["device"] for d in hosts["host-b"]["devices"]] == [3] and not hosts["host-b"]["ok"]
    assert hosts["host-b"]["failed"] == sum(c["outcome"] == "fail" for c in bad["cases"]) > 0
    assert hosts["host-a"]["soc"] == "Ascend910B3" and hosts["host-a"]["toolkit_version"] == "9.0.0"
    assert {(c["host"], c["device"]) for c in merged["cases"]} == {("host-a", 5), ("host-b", 3)}
    assert len(merged["cases"]) == 2 * len(good["cases"])
    differ = {c["name"] for c in good["cases"]} - {
        g["name"] for g, w in zip(good["cases"], bad["cases"]) if g["digest"] == w["digest"]}
    assert {d["name"] for d in merged["digest_differences"]} == differ != set()
    failed = {c["name"] for c in bad["cases"] if c["outcome"] == "fail"}
    assert all(d["odd"] == ["host-b"] for d in merged["digest_differences"] if d["name"] in failed)
    assert hosts["host-b"]["odd_digests"] >= len(failed) and hosts["host-a"]["odd_digests"] == 0
    assert "ODD HOST host-b" in out and "FAILED" in out and out.splitlines()[-1].endswith("(exit status 1)")
    import xmlschema

    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(out_xml)
    suites = ET.parse(out_xml).getroot().findall("testsuite")
    assert [s.get("name") for s in suites[:2]] == ["conformance on host-a", "conformance on host-b"]
    assert suites[1].get("failures") == str(len(failed)) and suites[2].get("failures") == str(len(differ))


def test_hosts_of_one_build_agree_and_exit_0(reports, capsys):
    folder, good, _ = reports
    paths = [_save(folder, f"same-{h}.json", _host(good, h)) for h in ("x", "y", "z")]
    code, out, err = _cli("merge", *paths, capsys=capsys)
    assert code == 0, out + err
    assert "3 host(s), 3 device(s)" in out and "0 output(s) differ" in out


def test_three_hosts_name_the_one_that_differs_even_where_its_case_passes(reports):
    folder, good, bad = reports
    merged = cluster.merge([("a", _host(good, "a")), ("b", _host(good, "b")), ("c", _host(bad, "c"))])
    assert merged["digest_differences"] and all(d["odd"] == ["c"] for d in merged["digest_differences"])


def test_hosts_of_another_chip_or_release_are_not_compared(reports):
    _, good, bad = reports
    other = dict(_host(bad, "b"), soc="Ascend910_9392")
    merged = cluster.merge([("a", _host(good, "a")), ("b", other)])
    assert merged["digest_differences"] == [] and merged["exit_status"] == 1  # (b still fails its cases)
    newer = dict(_host(good, "b"), toolkit_version="9.1.0")
    for c in newer["cases"]:
        c["digest"] = "sha256:" + "0" * 64
    assert cluster.merge([("a", _host(good, "a")), ("b", newer)])["exit_status"] == 0


def test_two_nodes_of_one_hostname_are_two_hosts(reports):
    _, good, _ = reports
    a = dict(_host(good, "vm"), node_id="a" * 56, node_ip="127.0.0.2")
    b = dict(_host(good, "vm"), node_id="b" * 56, node_ip="127.0.0.3")
    merged = cluster.merge([("a", a), ("b", b)])
    assert [h["host"] for h in merged["hosts"]] == ["vm (127.0.0.2)", "vm (127.0.0.3)"]
    assert [h["node_id"] for h in merged["hosts"]] == ["a" * 56, "b" * 56]


def test_cases_not_run_make_exit_2(reports):
    _, good, _ = reports
    r = _host(good, "a")
    r["cases"][0].update(outcome="error", detail="not run: the worker for device 0 exited with status -9")
    merged = cluster.merge([("a", r), ("b", _host(good, "b"))])
    assert merged["exit_status"] == 2 and merged["hosts"][0]["not_run"] == 1
    r["cases"][0].update(detail="RuntimeError: a crash of the harness")
    assert cluster.merge([("a", r), ("b", _host(good, "b"))])["exit_status"] == 1


@pytest.mark.parametrize("change, reason", [
    ({"seed": 7}, r"made with --seed 7, a\.json with --seed 0: every input differs"),
    ({"standard": "pyacl"}, r"judged by the pyacl standard, a\.json by stat-rel-err"),
    ({"strict": True}, r"run with --strict, a\.json without"),
    ({"profile": "full", "selection": {}}, r"another catalogue than a\.json \(the full profile, not the quick"),
    ({"selection": {"profile": "quick", "filter": "-small", "cases": 9, "digest": "sha256:0"}},
     r"another catalogue than a\.json \(the quick profile filtered by '-small', 9 cases"),
    ({"standards": {"float32": {"rtol": 1.0, "atol": 1.0, "max_share": 0.0}}}, r"other tolerances"),
])
def test_reports_of_another_catalogue_seed_or_standard_are_refused_with_the_reason(reports, change, reason, capsys):
    folder, good, _ = reports
    a = _save(folder, "a.json", _host(good, "a"))
    b = _save(folder, "b.json", {**_host(good, "b"), **change})
    code, out, err = _cli("merge", a, b, capsys=capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"pyacl-moe: error: {b}: ")
    assert re.search(reason.replace(r"a\.json", re.escape(str(a))), err), err


def test_a_case_twice_on_one_host_is_refused(reports, capsys):
    folder, good, _ = reports
    a = _save(folder, "twice.json", _host(good, "a"))
    code, _, err = _cli("merge", a, a, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "is also in" in err and "give each part once" in err, err


def _hostile(good):
    deep = "[" * 200000 + "]" * 200000
    case = good["cases"][0]
    yield "not json", b"{"
    yield "binary", bytes(range(256)) * 4
    yield "deep", deep.encode()
    yield "a list", b"[1, 2]"
    yield "no cases", json.dumps({k: v for k, v in good.items() if k != "cases"}).encode()
    yield "cases a dict", json.dumps({**good, "cases": {"a": 1}}).encode()
    yield "a nameless case", json.dumps({**good, "cases": [{"outcome": "pass"}]}).encode()
    yield "an unknown outcome", json.dumps({**good, "cases": [{**case, "outcome": "\x1b[2Jwin"}]}).encode()
    yield "a device that is text", json.dumps({**good, "cases": [{**case, "device": "0"}]}).encode()
    yield "a digest that is a number", json.dumps({**good, "cases": [{**case, "digest": 7}]}).encode()
    yield "a seed beyond any float", b'{"profile": "quick", "seed": 1e400, "cases": []}'
    yield "a seed that is true", json.dumps({**good, "seed": True}).encode()
    yield "devices of text", json.dumps({**good, "devices": ["0"]}).encode()
    yield "a case twice", json.dumps({**good, "cases": [case, case]}).encode()
    yield "problems of numbers", json.dumps({**good, "problems": [1]}).encode()
    yield "physical ids of another length", json.dumps({**good, "physical_devices": [1, 2]}).encode()
    yield "a merged report", json.dumps({"kind": cluster.MERGED_KIND, "hosts": []}).encode()
    yield "not utf-8", b'{"profile": "\xff"}'


def test_hostile_and_malformed_reports_are_one_line_naming_the_file(reports, capsys):
    folder, good, _ = reports
    ok = _save(folder, "ok.json", _host(good, "a"))
    for what, data in _hostile(good):
        path = folder / f"hostile-{what.replace(' ', '-')}.json"
        path.write_bytes(data)
        code, out, err = _cli("merge", ok, str(path), capsys=capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, (what, err[-3000:])
        assert err.startswith(f"pyacl-moe: error: {path}: ") and "Traceback" not in err, (what, err)
        assert "\x1b" not in err, what
    for path in (str(folder / "missing.json"), str(folder)):
        code, _, err = _cli("merge", path, capsys=capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"pyacl-moe: error: {path}: cannot read it"), err


def test_any_case_or_host_name_gives_a_table_for_a_terminal_and_well_formed_xml(reports, capsys):
    folder, good, bad = reports
    names = ["\x1b]0;owned\x07", "<x>&amp;\"'", "\x00\x0b\ud800", "é" * 3000, "]]>", "tab\there"]
    r = _host(bad, "\x1b[31mred host\x00")
    r["cases"] = [dict(bad["cases"][0], name=n, detail=n) for n in names]
    s = _host(good, "other <host>")
    s["cases"] = [dict(good["cases"][0], name=n) for n in names]
    for x in (r, s):  # the selection these six cases are the whole of
        x["selection"] = dict(x.get("selection") or {}, cases=len(names))
    a, b = _save(folder, "odd-a.json", r), _save(folder, "odd-b.json", s)
    xml = str(folder / "odd.xml")
    code, out, err = _cli("merge", a, b, "--junit", xml, capsys=capsys)
    assert code == 1, err
    assert not any(ch in out for ch in "\x1b\x00\x07\x0b"), out
    import xmlschema

    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(xml)
    root = ET.parse(xml).getroot()
    assert len(root.findall("testsuite")) == 3 and len(root.findall("testsuite/testcase")) > 2 * len(names)


# ---------------------------------------------------------------------------- --ray without Ray

def test_ray_without_ray_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, out, err = _cli("--emulator", "conformance", "--ray", "--filter=-tiny", capsys=capsys)
    assert code == 2 and out == "" and err == f"pyacl-moe: error: {cluster.RAY_HINT}\n", err
    assert "pip install 'pyacl-moe[ray]'" in cluster.RAY_HINT


@pytest.mark.parametrize("flags, named", [(["--devices", "0,1"], "--devices"), (["--device", "1"], "--device"),
                                          (["--report-csv", "r.csv"], "--report-csv"),
                                          (["--shard", "1/2"], "--shard")])
def test_ray_refuses_flags_of_one_host_naming_them(flags, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli("--emulator", "conformance", "--ray", "--filter=-tiny", *flags, capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and f"argument {named}:" in err, err


class _FakeRay:
    """What run_on_ray's collection asks of Ray, for tasks that end every way a task can."""

    def __init__(self, results):
        self.results, self.cancelled = results, []

    def wait(self, pending, num_returns, timeout):
        ready = [r for r in pending if r != "hung"][:num_returns]
        if not ready:
            time.sleep(timeout)
        return ready, [r for r in pending if r not in ready]

    def get(self, ref):
        outcome = self.results[ref]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def cancel(self, ref, force):
        self.cancelled.append((ref, force))


def test_a_task_that_dies_hangs_or_is_killed_leaves_its_cases_as_errors_and_exit_2():
    sel = conformance.select("quick", "-tiny")
    node = {"hostname": "h", "node_id": "n" * 56, "node_ip": "10.0.0.1", "label": "h"}
    ok = conformance.shard(sel, 1, 4)
    launched = {ref: (node, (i, 4), conformance.shard(sel, i, 4))
                for i, ref in enumerate(("killed", "crashed", "hung", "timed-out"), 1)}
    fake = _FakeRay({
        "killed": {"returncode": -9, "report": None, "stderr": "", "host_device": 1, "process_device": 0},
        "crashed": RuntimeError("The worker died unexpectedly"),
        "timed-out": {"returncode": -9, "timed_out": True, "report": None, "host_device": 3, "process_device": 0},
    })
    base = {"profile": "quick", "seed": 0, "standard": "stat-rel-err", "strict": False,
            "selection": conformance.selection("quick", "-tiny", sel)}
    t0 = time.monotonic()
    out = cluster._collect(fake, launched, 0.5, 10.0, base, cluster._RayProgress({"h": 4}, None))
    assert time.monotonic() - t0 < 5 and fake.cancelled == [("hung", True)]
    merged = cluster.merge(out)
    assert merged["exit_status"] == 2 and merged["totals"]["not_run"] == len(sel) and ok
    why = {c["report"].split("(part ")[1][:3]: c["detail"] for c in merged["cases"]}
    assert why["1/4"] == "not run: the conformance process was killed by signal 9"
    assert why["2/4"].startswith("not run: the Ray task failed (RuntimeError: The worker died")
    assert why["3/4"].startswith("not run: no result within --ray-timeout 10 s")
    assert why["4/4"] == "not run: the conformance process ran past --ray-timeout 10 s and was stopped"
    assert {c["device"] for c in merged["cases"] if c["report"].endswith("(part 1/4)")} == {1}
    assert len(merged["hosts"][0]["problems"]) == 4


# ---------------------------------------------------------------------------- ASCEND_RT_VISIBLE_DEVICES

@pytest.mark.parametrize("value, ids", [
    ("1", [1]), ("0,1", [0, 1]), ("1,3", [1, 3]), ("", []), ("x1", []), (",1", []), ("1, 2", [1]),
    ("1,,2", [1]), ("1,2,", [1, 2]), ("01,2", [1, 2]), ("1;2", [1]), ("2147483648", []),
    ("1,99999999999,2", [1]), ("٣", []), ("1" + ",2" * 100, [1] + [2] * 63),
])
def test_the_variable_is_split_as_the_runtime_splits_it(value, ids):
    assert visible.listed(value) == ids


def test_host_and_process_ids_map_both_ways():
    env = {visible.VARIABLE: "2,5"}
    assert [visible.host_device(d, env) for d in (0, 1)] == [2, 5]
    assert visible.process_device(5, env) == 1 and visible.process_device(3, env) is None
    assert visible.host_device(1, {}) == 1 and visible.process_device(4, {}) == 4


def child_visible_devices() -> None:
    from .emu_raw import Emu

    e = Emu()
    count = e.ffi.new("uint32_t *")
    st = int(e.acl.aclrtGetDeviceCount(count))
    msg = e.msg() if st else ""
    n = int(count[0]) if st == 0 else 0
    print(json.dumps({"status": st, "ids": [int(e.acl.aclemuVisibleDevice(i)) for i in range(n)],
                      "beyond": int(e.acl.aclemuVisibleDevice(n)), "set": int(e.acl.aclrtSetDevice(n)),
                      "message": msg}))


# value -> the host's ids visible, or the error: on a host of 4 devices (runtime.cc, GetVisibleDevices).
VISIBLE_CASES = {
    "2": [2], "1,3": [1, 3], "0,1,2,3,0": [0, 1, 2, 3], "1,7,2": [1], "3, 1": [3], "01": [1],
    "3,1": "ascending", "1,1": "twice", "1,2,1": "ascending", "": "names no device", "7": "names no device",
    "x": "names no device",
}


def test_the_emulator_makes_visible_what_the_runtime_would(isolated):
    procs = {v: start_isolated(child_visible_devices, env={"PYACL_MOE_EMULATOR": "1", "PYACL_MOE_EMU_DEVICES": "4",
                                                           visible.VARIABLE: v})
             for v in VISIBLE_CASES}
    for value, want in VISIBLE_CASES.items():
        out, err = procs[value].communicate(timeout=60)
        assert procs[value].returncode == 0, err
        got = json.loads(out.splitlines()[-1])
        if isinstance(want, list):
            assert got["status"] == 0 and got["ids"] == want, (value, got)
            assert got["beyond"] == -1 and got["set"] == 107001, (value, got)
            assert visible.listed(value)[:len(want)] == want
        else:
            assert got["status"] == 207004 and want in got["message"], (value, got)
            assert f'ASCEND_RT_VISIBLE_DEVICES="{value}"' in got["message"] and got["set"] == 107001


def test_without_the_variable_every_device_is_visible_as_itself(isolated):
    r = run_isolated(child_visible_devices, env={"PYACL_MOE_EMULATOR": "1", "PYACL_MOE_EMU_DEVICES": "3",
                                                 visible.VARIABLE: None})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["ids"] == [0, 1, 2]


def test_a_task_given_device_1_of_2_reports_physical_device_1(tmp_path):
    env = {**os.environ, "PYACL_MOE_EMU_DEVICES": "2", visible.VARIABLE: "1"}
    r = subprocess.run([sys.executable, "-m", "pyacl_moe.cli", "--emulator", "conformance", "--filter=-tiny",
                        "--report", str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml")],
                       capture_output=True, text=True, env=env, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["devices"] == [0] and data["physical_devices"] == [1] and data["visible_devices"] == "1"
    assert {c["device"] for c in data["cases"]} == {0}
    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "r.xml").getroot().iter("property")}
    assert props["physical_devices"] == "[1]"
    merged = cluster.merge([("r", cluster.read_report(str(tmp_path / "r.json")))])
    assert merged["hosts"][0]["devices"] == [{"device": 1, "process_device": 0, "visible_devices": "1"}]
    assert {c["device"] for c in merged["cases"]} == {1}


# ---------------------------------------------------------------------------- a real Ray cluster

def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _session_of(sid: int) -> list[int]:
    """The processes of session ``sid`` (what one ``ray start`` started, its workers included)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry))
    return out


class _Node:
    """One ``ray start --block`` of the test's cluster, in a session of its own, so that stopping
    it ends exactly what it started."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        ports = _free_ports(9)
        self.log = open(tmp / f"{name}.log", "w")
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--num-cpus=2",
               '--resources={"NPU": 2}', "--disable-usage-stats", "--object-store-memory=80000000",
               f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
               f"--min-worker-port={ports[2]}", f"--max-worker-port={ports[2] + 40}",
               f"--dashboard-agent-listen-port={ports[3]}", f"--dashboard-agent-grpc-port={ports[4]}",
               f"--runtime-env-agent-port={ports[5]}", f"--metrics-export-port={ports[6]}", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     cwd=str(tmp))

    def stop(self) -> None:
        """SIGTERM to ray start (it stops its node), then SIGKILL to whatever of its session is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(50):
            left = _session_of(self.proc.pid)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()
        assert not _session_of(self.proc.pid), "a process of the test's Ray node outlived it"


def _ray_conformance(tmp: Path, address: str, name: str, env: dict[str, str], timeout: float):
    cmd = [sys.executable, "-m", "pyacl_moe.cli", "--emulator", "conformance", "--ray", address,
           "--ray-timeout", "90", "--report", str(tmp / f"{name}.json"), "--junit", str(tmp / f"{name}.xml")]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp),
                            start_new_session=True)


def _conformance_children(marker: str) -> list[int]:
    """The conformance processes the tasks started (each runs a --shard, its --report under
    ``marker``), not the --ray run that started them."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"pyacl_moe.cli" in cmd and any(a.startswith(b"--shard=") for a in cmd)
                    and any(a.startswith(marker.encode()) for a in cmd)):
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_a_two_node_ray_cluster_names_the_node_with_a_wrong_kernel_and_a_killed_task_is_exit_2():
    pytest.importorskip("ray")
    if sys.version_info < (3, 10):
        pytest.skip("the ray extra needs Python 3.10")
    # Ray's sockets live under its temp folder, and a socket's path must stay within 107 bytes:
    # pytest's tmp_path is too deep for that.
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="pm-ray-", dir="/tmp"))
    # Ray turns 127.0.0.1 into the machine's own address (and refuses a second node in loopback-only
    # mode); 127.0.0.2 and .3 are loopback addresses it takes as given.
    base = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYACL_MOE_EMULATOR": "1", "TMPDIR": str(tmp)}
    for name in ("RAY_ADDRESS", visible.VARIABLE, cluster.NOSET):
        base.pop(name, None)
    gcs, dash = _free_ports(2)
    nodes = []
    t0 = time.monotonic()
    try:
        nodes.append(_Node(tmp, "head", ["--head", "--node-ip-address=127.0.0.2", f"--port={gcs}",
                                         "--include-dashboard=false", f"--dashboard-port={dash}",
                                         f"--temp-dir={tmp / 'ray'}"],
                           {**base, "PYACL_MOE_EMU_DEVICES": "2"}))
        address = f"127.0.0.2:{gcs}"
        deadline = time.monotonic() + 60
        while not (tmp / "ray" / "session_latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        # The second host: 4 devices of which Ray owns 2 and 3 (it reads them from the variable),
        # and a wrong kernel.
        nodes.append(_Node(tmp, "worker", [f"--address={address}", "--node-ip-address=127.0.0.3"],
                           {**base, "PYACL_MOE_EMU_DEVICES": "4", visible.VARIABLE: "2,3",
                            "PYACL_MOE_EMU_MUTATION": "fp16-accumulate"}))
        import ray

        for _ in range(120):  # both nodes up, with their NPUs
            probe = subprocess.run([sys.executable, "-c", "import ray, json; ray.init(address='%s', logging_level=40);"
                                    "print(json.dumps([n['Resources'].get('NPU', 0) for n in ray.nodes() "
                                    "if n['Alive']]))" % address], capture_output=True, text=True, timeout=60,
                                   env=base)
            if probe.returncode == 0 and json.loads(probe.stdout.splitlines()[-1]) == [2.0, 2.0]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the cluster did not come up: {probe.stderr[-2000:]}")
        assert ray  # (imported for the skip above)
        started = time.monotonic()

        run = _ray_conformance(tmp, address, "cluster", base, 120)
        out, err = run.communicate(timeout=150)
        assert run.returncode == 1, out[-3000:] + err[-3000:]
        merged = json.loads((tmp / "cluster.json").read_text())
        hosts = {h["node_ip"]: h for h in merged["hosts"]}
        assert set(hosts) == {"127.0.0.2", "127.0.0.3"}
        assert [d["device"] for d in hosts["127.0.0.2"]["devices"]] == [0, 1]
        assert [d["device"] for d in hosts["127.0.0.3"]["devices"]] == [2, 3]
        assert [d["process_device"] for d in hosts["127.0.0.3"]["devices"]] == [0, 0]
        n = len(conformance.select("quick"))
        assert hosts["127.0.0.2"]["ok"] and hosts["127.0.0.2"]["passed"] == n - hosts["127.0.0.2"]["differs"]
        bad = hosts["127.0.0.3"]
        assert not bad["ok"] and bad["failed"] > 0 and bad["cases"] == n and bad["odd_digests"] >= bad["failed"]
        assert merged["digest_differences"] and all(d["odd"] in ([bad["host"]], [])
                                                    for d in merged["digest_differences"])
        assert {c["host"] for c in merged["cases"] if c["outcome"] == "fail"} == {bad["host"]}
        assert f"ODD HOST {bad['host']}" in out and ET.parse(tmp / "cluster.xml").getroot().tag == "testsuites"
        first_run = time.monotonic() - started

        # A task's conformance process killed midway: its cases are errors, the run exits 2.
        started = time.monotonic()
        run = _ray_conformance(tmp, address, "killed", base, 120)
        killed = []
        while not killed and run.poll() is None and time.monotonic() - started < 90:
            children = _conformance_children(str(tmp))
            if children:
                os.kill(children[0], signal.SIGKILL)
                killed = children[:1]
            time.sleep(0.01)
        out, err = run.communicate(timeout=150)
        assert killed and run.returncode == 2, out[-3000:] + err[-3000:]
        merged = json.loads((tmp / "killed.json").read_text())
        not_run = [c for c in merged["cases"] if c["outcome"] == "error"]
        assert not_run and all(c["detail"] == "not run: the conformance process was killed by signal 9"
                               for c in not_run)
        assert len({c["report"] for c in not_run}) == 1 and merged["totals"]["not_run"] == len(not_run)
        assert "the conformance process was killed by signal 9" in out
        assert time.monotonic() - started < 90
        print(f"cluster up in {started - t0 - first_run:.1f} s; --ray run {first_run:.1f} s; killed run "
              f"{time.monotonic() - started:.1f} s")
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(tmp, ignore_errors=True)
