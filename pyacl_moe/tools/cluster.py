"""Conformance across a cluster: reports of several hosts and devices merged into one verdict
(``pyacl-moe merge``), and the run itself on Ray (``pyacl-moe conformance --ray``).

A *host* is a machine (its hostname, and its Ray node id where there is one). Each host runs the
selected cases, spread over its devices (``conformance --shard I/N`` per device, or
``--devices``); :func:`merge` joins the reports: every case tagged with its host and the host's
id of its device, a ``hosts`` section, and the cases whose output digest differs between hosts
of the same chip and release (as ``--baseline`` lists changed cases). One exit status for the
whole (:func:`exit_status`): 0 every case passed and those outputs agree, 1 a case failed or
outputs differ, 2 a host could not run (cases not run, or none ran).

On Ray (:func:`run_on_ray`) one task per NPU of the cluster (``resources={"NPU": 1}`` on its
node) runs its node's share of the cases in a child process, with a timeout; a task, process or
node that dies leaves its cases reported as errors (not run), never a hung run. Ray is
imported only here, and only by :func:`run_on_ray` and the task.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

from .. import __version__
from .._paths import read_regular
from . import conformance, visible
from .harness import OUTCOMES, Case

__all__ = ["MERGED_KIND", "RAY_HINT", "ClusterError", "check_report", "exit_status", "merge", "merge_command",
           "ray_command", "read_report", "run_on_ray", "table", "write_json", "write_junit"]

MERGED_KIND = "pyacl-moe merged conformance report"
RAY_HINT = "--ray needs Ray: pip install 'pyacl-moe[ray]' (Python 3.10 and later)"
MAX_REPORT_BYTES = conformance.MAX_REPORT_BYTES
MAX_CASES = 1 << 20
NOT_RUN = "not run: "  # how a case that never ran begins its detail (as conformance's workers write it)
SHOWN = 10  # failing cases (per host) and differing outputs the table names; the reports hold all
# What must match between the hosts whose output bits are compared: the chip and the release.
_RELEASE = ("backend", "toolkit_version", "ops_version")


class ClusterError(ValueError):
    """Reports that cannot be merged, or a cluster that cannot be run on: one line saying
    which file (or flag) and why."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


# ---------------------------------------------------------------------------- reading reports

def _shown(value: Any) -> str:
    text = repr(value)
    return conformance.printable(text if len(text) <= 60 else text[:57] + "...")


def read_report(path: str) -> dict[str, Any]:
    """A report written by ``conformance --report``, checked (:func:`check_report`); anything
    else is a ClusterError naming the file."""
    where = conformance.printable(path)
    try:
        raw = read_regular(path, MAX_REPORT_BYTES)
        if len(raw) > MAX_REPORT_BYTES:
            raise ClusterError(f"{where}: more than a report holds ({MAX_REPORT_BYTES} bytes)")
        data = json.loads(raw.decode("utf-8"))
    except OSError as exc:
        raise ClusterError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ClusterError(f"{where}: not a JSON report ({conformance.printable(str(exc))[:200]})") from None
    return check_report(data, where)


def _kind(value: Any, kinds: tuple[type, ...], none: bool) -> bool:
    if value is None:
        return none
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


_TOP: dict[str, tuple[tuple[type, ...], bool]] = {
    "host": ((str,), True), "node_id": ((str,), True), "node_ip": ((str,), True), "profile": ((str,), False),
    "seed": ((int,), False), "standard": ((str,), True), "strict": ((bool,), True), "soc": ((str,), True),
    "backend": ((str,), True), "cann_version": ((str,), True), "toolkit_version": ((str,), True),
    "ops_version": ((str,), True), "runtime_version": ((str,), True), "acl_version": ((str,), True),
    "op_library": ((str,), True), "pyacl_moe": ((str,), True), "visible_devices": ((str,), True),
    "selection": ((dict,), True), "shard": ((dict,), True), "standards": ((dict,), True),
    "timestamp": ((str,), True), "seconds": ((int, float), True),
}
_CASE: dict[str, tuple[tuple[type, ...], bool]] = {
    "kind": ((str,), True), "dtype": ((str,), True), "scenario": ((str,), True), "shape": ((str,), True),
    "detail": ((str,), True), "digest": ((str,), True), "device": ((int,), True), "op": ((str,), True),
    "source": ((str,), True), "judged_by": ((str,), True), "seconds": ((int, float), True),
}


def check_report(data: Any, where: str) -> dict[str, Any]:
    """``data`` if it is a conformance report merge can read (the fields it uses, of the types
    it writes them); otherwise a ClusterError saying what is wrong, naming ``where``."""
    def bad(what: str) -> ClusterError:
        return ClusterError(f"{where}: not a conformance report: {what}")

    if not isinstance(data, dict):
        raise bad(f"a JSON {type(data).__name__}, not an object")
    if data.get("kind") == MERGED_KIND:
        raise ClusterError(f"{where}: a merged report; merge the hosts' own reports")
    for key in ("profile", "seed", "cases"):
        if key not in data:
            raise bad(f"no {key!r}")
    for key, (kinds, none) in _TOP.items():
        if key in data and not _kind(data[key], kinds, none):
            raise bad(f"{key!r} is {_shown(data[key])}")
    if data["seed"] < 0:
        raise bad(f"'seed' is {data['seed']}")
    for key in ("devices", "physical_devices"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(_kind(d, (int,), False) and d >= 0 for d in value):
            raise bad(f"{key!r} is {_shown(value)}, not a list of device ids")
    if "physical_devices" in data and len(data["physical_devices"]) != len(data.get("devices", [])):
        raise bad("'physical_devices' and 'devices' differ in length")
    problems = data.get("problems", [])
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise bad(f"'problems' is {_shown(problems)}")
    cases = data["cases"]
    if not isinstance(cases, list) or len(cases) > MAX_CASES:
        raise bad("'cases' is not a list of at most a million cases")
    seen: set[str] = set()
    for i, c in enumerate(cases):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
            raise bad(f"case {i + 1} has no name")
        name = _shown(c["name"])
        if c.get("outcome") not in OUTCOMES:
            raise bad(f"case {name} has the outcome {_shown(c.get('outcome'))}, not one of {', '.join(OUTCOMES)}")
        for key, (kinds, none) in _CASE.items():
            if key in c and not _kind(c[key], kinds, none):
                raise bad(f"case {name}: {key!r} is {_shown(c[key])}")
        if c["name"] in seen:
            raise bad(f"case {name} is there twice")
        seen.add(c["name"])
    out: dict[str, Any] = data
    return out


# ---------------------------------------------------------------------------- merging

def _not_run(case: dict[str, Any]) -> bool:
    return case["outcome"] == "error" and str(case.get("detail", "")).startswith(NOT_RUN)


def _failing(case: dict[str, Any], strict: bool) -> bool:
    return case["outcome"] in ("fail", "error") or (strict and case["outcome"] == "differs")


def _judged(report: dict[str, Any]) -> dict[str, Any]:
    """What must be the same for two reports to be merged, by name."""
    sel = report.get("selection") or {}
    return {
        "catalogue": (sel.get("digest"), sel.get("cases")) if sel.get("digest") else (report["profile"],),
        "seed": report["seed"], "standard": report.get("standard"), "strict": bool(report.get("strict")),
        "tolerances": report.get("standards"),
    }


def _describe(report: dict[str, Any]) -> str:
    sel = report.get("selection") or {}
    text = f"the {report['profile']} profile"
    if sel.get("filter"):
        text += f" filtered by {_shown(sel['filter'])}"
    if isinstance(sel.get("cases"), int):
        text += f", {sel['cases']} cases"
    return text


def _compatible(first: tuple[str, dict[str, Any]], other: tuple[str, dict[str, Any]]) -> None:
    (wa, a), (wb, b) = first, other
    ja, jb = _judged(a), _judged(b)
    if ja["catalogue"] != jb["catalogue"]:
        raise ClusterError(f"{wb}: another catalogue than {wa} ({_describe(b)}, not {_describe(a)}"
                           f"{'' if _describe(a) != _describe(b) else ', with other cases'}): merge reports of one "
                           "selection of one pyacl-moe")
    if ja["seed"] != jb["seed"]:
        raise ClusterError(f"{wb}: made with --seed {b['seed']}, {wa} with --seed {a['seed']}: every input "
                           "differs, so would every output")
    if ja["standard"] != jb["standard"]:
        raise ClusterError(f"{wb}: judged by the {jb['standard']} standard, {wa} by {ja['standard']}")
    if ja["strict"] != jb["strict"]:
        raise ClusterError(f"{wb}: run {'with' if jb['strict'] else 'without'} --strict, {wa} "
                           f"{'with' if ja['strict'] else 'without'}")
    if ja["tolerances"] is not None and jb["tolerances"] is not None and ja["tolerances"] != jb["tolerances"]:
        raise ClusterError(f"{wb}: judged with other tolerances (--rtol/--atol) than {wa}")


_HOST_FIELDS = ("soc", "chip", "backend", "cann_version", "toolkit_version", "ops_version", "runtime_version",
                "acl_version", "op_library", "pyacl_moe", "node_ip")


def merge(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report from ``reports`` ((where, checked report) pairs: a file's path, or a Ray
    task's name): the hosts, every case tagged with its host and device, the digests that differ
    between hosts of the same chip and release, the cases no report ran, and the exit status.
    Reports of different catalogues, seeds or standards, or a case twice on one host, are a
    ClusterError naming the report and the reason."""
    if not reports:
        raise ClusterError("no report to merge")
    for other in reports[1:]:
        _compatible(reports[0], other)
    first = reports[0][1]
    strict = bool(first.get("strict"))
    keys: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
    for where, r in reports:
        keys.setdefault((r.get("host") or "localhost", r.get("node_id") or ""), []).append((where, r))
    names = Counter(host for host, _ in keys)
    ips: dict[str, Counter[str]] = {}
    for (hostname, _), parts in keys.items():
        ips.setdefault(hostname, Counter()).update({str(parts[0][1].get("node_ip") or "")})
    hosts: list[dict[str, Any]] = []
    cases: list[dict[str, Any]] = []
    ran: dict[str, dict[str, tuple[str, str | None]]] = {}  # host label -> case -> (outcome, digest)
    for (hostname, node), parts in keys.items():
        # One host per hostname reads as its name; hosts that share one (nodes of one machine, or
        # machines of one name) are told apart by their address, else by their node id.
        ip = str(parts[0][1].get("node_ip") or "")
        label = hostname if names[hostname] == 1 else f"{hostname} ({ip})" if ip and ips[hostname][ip] == 1 \
            else f"{hostname} (node {node[:12] or 'unknown'})"
        info: dict[str, Any] = {"host": label, "hostname": hostname, "node_id": node or None}
        for field_name in _HOST_FIELDS:
            values = {(w, r.get(field_name)) for w, r in parts if r.get(field_name) is not None}
            if len({v for _, v in values}) > 1 and field_name not in ("op_library", "node_ip"):
                (w1, v1), (w2, v2) = sorted(values, key=str)[:2]
                raise ClusterError(f"{w2}: host {conformance.printable(label)} reports {field_name} {_shown(v2)}, "
                                   f"{w1} {_shown(v1)}: one host, one install")
            info[field_name] = sorted((v for _, v in values), key=str)[0] if values else None
        devices: dict[int, dict[str, Any]] = {}
        mine: dict[str, tuple[str, str | None]] = {}
        origin: dict[str, str] = {}
        problems: list[str] = []
        for where, r in parts:
            problems += r.get("problems", [])
            procs = r.get("devices", [])
            phys = r.get("physical_devices") or procs
            for d, p in zip(procs, phys):
                devices.setdefault(p, {"device": p, "process_device": d, "visible_devices": r.get("visible_devices")})
            for c in r["cases"]:
                if c["name"] in origin:
                    raise ClusterError(f"{where}: case {_shown(c['name'])} of host {conformance.printable(label)} is "
                                       f"also in {origin[c['name']]}: give each part once")
                origin[c["name"]] = where
                d = c.get("device")
                tagged = dict(c, host=label, process_device=d,
                              device=phys[procs.index(d)] if d in procs else d, report=where)
                cases.append(tagged)
                mine[c["name"]] = (c["outcome"], c.get("digest") or None)
        ran[label] = mine
        host_cases = [c for c in cases if c["host"] == label]
        info.update(
            devices=sorted(devices.values(), key=lambda v: v["device"]), reports=[w for w, _ in parts],
            cases=len(host_cases), passed=sum(c["outcome"] == "pass" for c in host_cases),
            failed=sum(c["outcome"] == "fail" or (strict and c["outcome"] == "differs") for c in host_cases),
            errors=sum(c["outcome"] == "error" and not _not_run(c) for c in host_cases),
            not_run=sum(_not_run(c) for c in host_cases), differs=sum(c["outcome"] == "differs" for c in host_cases),
            skipped=sum(c["outcome"] == "skipped" for c in host_cases), problems=problems, odd_digests=0,
        )
        hosts.append(info)
    differences = _differences(hosts, ran)
    for h in hosts:
        h["odd_digests"] = sum(h["host"] in d["odd"] for d in differences)
        h["ok"] = (not h["problems"] and h["not_run"] == 0 and h["failed"] == 0 and h["errors"] == 0
                   and h["odd_digests"] == 0 and h["cases"] > h["skipped"])
    expected = (first.get("selection") or {}).get("cases")
    union = {c["name"] for c in cases}
    missing = max(0, expected - len(union)) if isinstance(expected, int) else 0
    merged: dict[str, Any] = {
        "kind": MERGED_KIND, "pyacl_moe": __version__,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "profile": first["profile"], "seed": first["seed"], "standard": first.get("standard"), "strict": strict,
        "selection": first.get("selection") or {}, "standards": first.get("standards"),
        "reports": [w for w, _ in reports], "hosts": hosts, "digest_differences": differences,
        "missing": missing, "cases": cases,
    }
    merged["totals"] = {k: sum(h[k] for h in hosts) for k in ("cases", "passed", "failed", "errors", "not_run",
                                                                 "differs", "skipped")}
    merged["exit_status"] = exit_status(merged)
    merged["ok"] = merged["exit_status"] == 0
    return merged


def _differences(hosts: list[dict[str, Any]],
                 ran: dict[str, dict[str, tuple[str, str | None]]]) -> list[dict[str, Any]]:
    """Cases whose output digest differs between hosts of the same chip and release. ``odd``:
    the hosts outside the largest group of equal digests; where two groups are as large, those
    whose case failed; none where that does not decide either."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for h in hosts:
        if h["soc"] is not None:
            groups.setdefault((h["soc"], *(h[k] for k in _RELEASE)), []).append(h["host"])
    out = []
    for key, labels in groups.items():
        if len(labels) < 2:
            continue
        names = list(dict.fromkeys(n for lab in labels for n in ran[lab]))
        for name in names:
            seen = {lab: ran[lab][name] for lab in labels
                    if name in ran[lab] and ran[lab][name][1] and ran[lab][name][0] != "skipped"}
            if len(seen) < 2 or len({d for _, d in seen.values()}) < 2:
                continue
            by_digest: dict[str, list[str]] = {}
            for lab, (_, dig) in seen.items():
                by_digest.setdefault(str(dig), []).append(lab)
            sizes = sorted((len(v) for v in by_digest.values()), reverse=True)
            if sizes[0] > sizes[1]:
                top = max(by_digest.values(), key=len)
                odd = sorted(lab for lab in seen if lab not in top)
            else:
                odd = sorted(lab for lab, (outcome, _) in seen.items() if outcome in ("fail", "error"))
                if len(odd) == len(seen):
                    odd = []
            out.append({"name": name, "soc": key[0], "release": dict(zip(_RELEASE, key[1:])),
                        "digests": {lab: dig for lab, (_, dig) in seen.items()}, "odd": odd})
    return out


def exit_status(merged: dict[str, Any]) -> int:
    """2 a host could not run (a problem, a case not run, a case of the selection in no report,
    or no case ran at all); else 1 a case failed or outputs differ between hosts of the same chip
    and release; else 0."""
    t = {k: sum(h[k] for h in merged["hosts"]) for k in ("cases", "skipped", "not_run", "failed", "errors")}
    if any(h["problems"] for h in merged["hosts"]) or t["not_run"] or merged["missing"] or t["cases"] <= t["skipped"]:
        return 2
    if t["failed"] or t["errors"] or merged["digest_differences"]:
        return 1
    return 0


# ---------------------------------------------------------------------------- writing

def write_json(merged: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")


def _verdict(merged: dict[str, Any]) -> str:
    t = merged["totals"]
    devices = sum(len(h["devices"]) for h in merged["hosts"])
    parts = [f"{t['passed']} passed", f"{t['failed']} failed", f"{t['errors']} errors"]
    if t["not_run"]:
        parts.append(f"{t['not_run']} not run")
    if t["skipped"]:
        parts.append(f"{t['skipped']} skipped")
    text = (f"{len(merged['hosts'])} host(s), {devices} device(s), {t['cases']} cases: {', '.join(parts)}; "
            f"{len(merged['digest_differences'])} output(s) differ between hosts of the same chip and release")
    if merged["missing"]:
        text += f"; {merged['missing']} case(s) of the selection in no report"
    return text + f" (exit status {merged['exit_status']})"


def table(merged: dict[str, Any]) -> str:
    """The hosts, one row each, then what failed, what was not run and which outputs differ."""
    p = conformance.printable
    rows: list[tuple[str, ...]] = [("host", "chip", "CANN", "devices", "cases", "passed", "failed", "errors",
                                    "not run", "odd digests", "result")]
    for h in merged["hosts"]:
        rows.append((p(h["host"]), p(str(h["soc"] or "?")), p(str(h["toolkit_version"] or "?")),
                     ",".join(str(d["device"]) for d in h["devices"]) or "-", str(h["cases"]), str(h["passed"]),
                     str(h["failed"]), str(h["errors"]), str(h["not_run"]), str(h["odd_digests"]),
                     "PASS" if h["ok"] else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    strict = merged["strict"]
    for h in merged["hosts"]:
        for problem in h["problems"]:
            lines.append(f"HOST {p(h['host'])}: {p(problem)}")
    not_run: Counter[str] = Counter()
    failing: Counter[str] = Counter()
    for c in merged["cases"]:
        first = p(str(c.get("detail", "")).splitlines()[0] if c.get("detail") else "")
        where = p(c["host"]) + ("" if c["device"] is None else f" device {c['device']}")
        if _not_run(c):
            not_run[f"{where}: {first}"] += 1
        elif _failing(c, strict):
            failing[c["host"]] += 1
            if failing[c["host"]] <= SHOWN:
                lines.append(f"{'ERROR' if c['outcome'] == 'error' else 'FAILED'} {p(c['name'])} on {where}: {first}")
    lines += [f"... and {n - SHOWN} more failing on {p(h)} (the report lists them)" for h, n in failing.items()
              if n > SHOWN]
    lines += [f"NOT RUN {n} case(s) on {what}" for what, n in not_run.items()]
    diffs = merged["digest_differences"]
    for d in diffs[:SHOWN]:
        shown = ", ".join(f"{p(lab)} {str(dig)[:19]}" for lab, dig in sorted(d["digests"].items()))
        odd = f" (odd: {', '.join(map(p, d['odd']))})" if d["odd"] else " (no host is the odd one)"
        lines.append(f"DIGEST {p(d['name'])}: {shown}{odd}")
    if len(diffs) > SHOWN:
        lines.append(f"... and {len(diffs) - SHOWN} more outputs that differ (the report lists them)")
    for h in merged["hosts"]:
        if h["odd_digests"]:
            lines.append(f"ODD HOST {p(h['host'])}: its output differs from the other hosts' in {h['odd_digests']} "
                         "case(s)")
    lines.append(_verdict(merged))
    return "\n".join(lines)


def _seconds(value: Any) -> float:
    """A case's seconds as JUnit takes them: a finite number >= 0 (0 for anything else)."""
    x = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
    return x if math.isfinite(x) and x >= 0 else 0.0


def _junit_case(suite: ET.Element, c: dict[str, Any], strict: bool) -> None:
    tc = ET.SubElement(suite, "testcase", classname=f"conformance.{c.get('kind') or 'case'}", name=c["name"],
                       time=f"{_seconds(c.get('seconds')):.3f}")
    text = json.dumps(c, indent=1)
    detail = str(c.get("detail") or "")
    if c["outcome"] == "error":
        ET.SubElement(tc, "error", message=detail.splitlines()[0] if detail else "error",
                      type="not-run" if _not_run(c) else "harness").text = text
    elif _failing(c, strict):
        ET.SubElement(tc, "failure", message=detail or "failed", type=str(c.get("kind") or "case")).text = text
    elif c["outcome"] == "skipped":
        ET.SubElement(tc, "skipped", message=detail)
    else:
        ET.SubElement(tc, "system-out").text = text


def write_junit(merged: dict[str, Any], path: str) -> None:
    """JUnit XML: one testsuite per host (its cases, properties naming the host, chip, release
    and devices), and one for the output digests compared between hosts (a failure per case
    that differs). Well-formed for any case or host name (conformance.xml_text)."""
    strict = merged["strict"]
    t = merged["totals"]
    when = merged["timestamp"][:19]
    seconds = sum(_seconds(c.get("seconds")) for c in merged["cases"])
    root = ET.Element("testsuites", name="aclnnMoeInitRoutingV2Grad and aclnnMoeInitRoutingV2 conformance, merged",
                      tests=str(t["cases"] + max(1, len(merged["digest_differences"]))),
                      failures=str(t["failed"] + len(merged["digest_differences"])),
                      errors=str(t["errors"] + t["not_run"]), time=f"{max(seconds, 0.0):.3f}")
    for h in merged["hosts"]:
        mine = [c for c in merged["cases"] if c["host"] == h["host"]]
        suite = ET.SubElement(root, "testsuite", name=f"conformance on {h['host']}", tests=str(len(mine)),
                              failures=str(h["failed"]), errors=str(h["errors"] + h["not_run"]),
                              skipped=str(h["skipped"]),
                              time=f"{sum(_seconds(c.get('seconds')) for c in mine):.3f}",
                              timestamp=when, hostname=h["hostname"].strip() or "localhost")
        props = ET.SubElement(suite, "properties")
        for key in ("host", "hostname", "node_id", "node_ip", *_HOST_FIELDS[:-1]):
            value = h.get(key)
            ET.SubElement(props, "property", name=key, value="" if value is None else str(value))
        ET.SubElement(props, "property", name="devices", value=",".join(str(d["device"]) for d in h["devices"]))
        for problem in h["problems"]:
            ET.SubElement(props, "property", name="problem", value=problem)
        for c in mine:
            _junit_case(suite, c, strict)
        ET.SubElement(suite, "system-out").text = "\n".join([*h["problems"], _verdict(merged)])
        ET.SubElement(suite, "system-err").text = ""
    diffs = merged["digest_differences"]
    suite = ET.SubElement(root, "testsuite", name="output digests between hosts of the same chip and release",
                          tests=str(max(1, len(diffs))), failures=str(len(diffs)), errors="0", skipped="0",
                          time="0.000", timestamp=when, hostname=socket.gethostname() or "localhost")
    ET.SubElement(suite, "properties")
    for d in diffs:
        tc = ET.SubElement(suite, "testcase", classname="conformance.digest", name=d["name"], time="0.000")
        odd = ", ".join(d["odd"]) or "no host is the odd one"
        ET.SubElement(tc, "failure", message=f"the output differs between hosts (odd: {odd})",
                      type="digest").text = json.dumps(d, indent=1)
    if not diffs:
        ET.SubElement(suite, "testcase", classname="conformance.digest", name="every output compared agrees",
                      time="0.000")
    ET.SubElement(suite, "system-out").text = _verdict(merged)
    ET.SubElement(suite, "system-err").text = ""
    for el in root.iter():
        el.text, el.tail = conformance.xml_text(el.text), conformance.xml_text(el.tail)
        el.attrib.update({k: conformance.xml_text(v) or "" for k, v in el.attrib.items()})
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _write(merged: dict[str, Any], report: str | None, junit: str | None) -> None:
    try:
        if report:
            write_json(merged, report)
        if junit:
            write_junit(merged, junit)
    except OSError as exc:
        raise ClusterError(f"cannot write the report: {exc}") from None


def merge_command(paths: Sequence[str], report: str | None = None, junit: str | None = None,
                  out: TextIO | None = None) -> int:
    """``pyacl-moe merge``: read, merge, print the table, write the reports; the exit status."""
    merged = merge([(conformance.printable(p), read_report(p)) for p in paths])
    print(table(merged), file=out or sys.stdout)
    _write(merged, report, junit)
    status: int = merged["exit_status"]
    return status


# ---------------------------------------------------------------------------- Ray

NOSET = "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"


def _ray_flag(value: str | None) -> bool:
    """Whether Ray reads an environment flag as set ("1" or "true", any case)."""
    return (value or "").lower() in ("1", "true")


def _die_with_parent() -> Any:
    """A preexec_fn that makes the child get SIGKILL when the task's worker dies (Linux), so a
    killed worker leaves no conformance process behind."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, before the fork

    def arm() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return arm


def _npu_task(global_argv: list[str], conformance_argv: list[str], part: tuple[int, int],
              timeout: float) -> dict[str, Any]:
    """One NPU's part of a host's cases, in a Ray worker: ``pyacl-moe conformance --shard I/N``
    in a child process on the NPU Ray gave the task (Ray sets ASCEND_RT_VISIBLE_DEVICES to it,
    so it is the child's device 0; where RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES is
    set the variable is left as the user has it and the child is given that NPU's id under it).
    Returns what happened and the child's report (None when it wrote none)."""
    import ray as _ray  # type: ignore[import-not-found,unused-ignore]  # (an optional extra)

    ray: Any = _ray  # (some of its functions are untyped)
    t0 = time.monotonic()
    ctx = ray.get_runtime_context()
    ids = [str(i) for i in (ctx.get_accelerator_ids().get("NPU") or [])]
    env = dict(os.environ)
    result: dict[str, Any] = {"hostname": socket.gethostname() or "localhost", "node_id": ctx.get_node_id(),
                              "node_ip": ray.util.get_node_ip_address(), "npu_ids": ids,
                              "visible_devices": env.get(visible.VARIABLE), "report": None, "returncode": None,
                              "timed_out": False, "problem": ""}
    device_args: list[str] = []
    try:
        host_id = int(ids[0]) if ids else visible.host_device(0, env)
    except ValueError:
        result["problem"] = f"Ray gave the task the NPU {ids[0]!r}, not a device id"
        return result
    if _ray_flag(env.get(NOSET)):
        user = visible.process_device(host_id, env)
        if user is None:
            result["problem"] = (f"NPU {host_id} is hidden by {visible.VARIABLE}={env.get(visible.VARIABLE)!r} "
                                 f"(Ray was told not to set it: {NOSET})")
            return result
        device_args = ["--device", str(user)]
    else:
        user = 0
    result["host_device"], result["process_device"] = host_id, user
    folder = tempfile.mkdtemp(prefix="pyacl-moe-npu-")
    path = os.path.join(folder, "report.json")
    cmd = [sys.executable, "-m", "pyacl_moe.cli", *global_argv, "conformance", *conformance_argv,
           f"--shard={part[0]}/{part[1]}", *device_args, "--report", path]
    try:
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=env, start_new_session=True, preexec_fn=_die_with_parent()) as proc:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
                result["timed_out"] = True
        result["returncode"] = proc.returncode
        result["stderr"] = err.decode("utf-8", "backslashreplace")[-4000:]
        if os.path.exists(path) and not result["timed_out"]:
            with open(path, encoding="utf-8") as f:
                result["report"] = json.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        result["seconds"] = time.monotonic() - t0
    return result


def _why(result: dict[str, Any], timeout: float) -> str:
    """Why a task has no report, in one line."""
    if result.get("problem"):
        return str(result["problem"])
    code = result.get("returncode")
    if result.get("timed_out"):
        return f"the conformance process ran past --ray-timeout {timeout:g} s and was stopped"
    lines = [ln for ln in str(result.get("stderr") or "").splitlines() if ln.strip()]
    said = f": {lines[-1].strip()}" if lines else ""
    if isinstance(code, int) and code < 0:
        return f"the conformance process was killed by signal {-code}{said}"
    return f"the conformance process exited with status {code} and wrote no report{said}"


def _placeholder(where: dict[str, Any], base: dict[str, Any], cases: list[Case], reason: str) -> dict[str, Any]:
    """A report for a part that did not run: its cases as errors, not run, and why."""
    rows = []
    for c in cases:
        rows.append({"name": c.name, "kind": c.kind, "dtype": c.dtype, "scenario": c.scenario, "shape": c.shape,
                     "passed": False, "outcome": "error", "detail": NOT_RUN + reason, "source": c.source,
                     "op": c.op, "judged_by": c.judged_by, "device": where.get("process_device"), "digest": None,
                     "nbytes": c.nbytes, "seconds": 0.0})
    return {**base, "host": where.get("hostname"), "node_id": where.get("node_id"), "node_ip": where.get("node_ip"),
            "devices": [where["process_device"]] if where.get("process_device") is not None else [],
            "physical_devices": [where["host_device"]] if where.get("host_device") is not None else [],
            "visible_devices": where.get("visible_devices"), "cases": rows, "problems": [reason]}


class _RayProgress:
    """Tasks done per host, redrawn in place on a terminal; a line per finished task elsewhere."""

    def __init__(self, hosts: dict[str, int], stream: TextIO | None) -> None:
        self.total, self.done, self.stream = hosts, dict.fromkeys(hosts, 0), stream
        self.cases = self.failing = 0
        self.tty = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())

    def step(self, host: str, line: str, cases: int, failing: int) -> None:
        self.done[host] += 1
        self.cases += cases
        self.failing += failing
        if self.stream is None:
            return
        if self.tty:
            shown = ", ".join(f"{conformance.printable(h)} {self.done[h]}/{n}" for h, n in self.total.items())
            bad = f", {self.failing} failing" if self.failing else ""
            self.stream.write(f"\r\x1b[Kray: NPU tasks done: {shown}; {self.cases} cases{bad}")
        else:
            self.stream.write(f"ray: {conformance.printable(line)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.stream is not None:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def run_on_ray(address: str, global_argv: list[str], conformance_argv: list[str], selected: list[Case],
               base: dict[str, Any], timeout: float = 3600.0, progress: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Run ``pyacl-moe conformance`` on every NPU of the Ray cluster at ``address`` ("auto": the
    one this machine belongs to): each live node with an ``NPU`` resource gets one task per NPU
    (``resources={"NPU": 1}``, placed on that node; no more tasks than cases), the node's N
    tasks running parts 1/N to N/N of ``selected``; then :func:`merge`. ``base``: the fields of
    a report of this selection (seed, standard, ...), for the parts that could not run. A task
    still running ``timeout`` seconds after the last was placed (plus a minute for Ray to
    schedule it) is cancelled; its cases, and those of a task whose process or node died, are errors, not run."""
    if sys.version_info < (3, 10):
        raise ClusterError(RAY_HINT)
    try:
        import ray as _ray  # type: ignore[import-not-found,unused-ignore]  # (an optional extra)
        from ray.util.scheduling_strategies import (  # type: ignore[import-not-found,unused-ignore]
            NodeAffinitySchedulingStrategy,
        )
    except ImportError:
        raise ClusterError(RAY_HINT) from None
    import logging

    ray: Any = _ray  # (some of its functions are untyped)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # ConnectionError and whatever else Ray raises for an address
        first = conformance.printable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise ClusterError(f"{conformance.printable(address)}: cannot connect to a Ray cluster there ({first})",
                           "--ray") from None
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive") and int(n.get("Resources", {}).get("NPU", 0)) >= 1]
        if not nodes:
            raise ClusterError(f"{conformance.printable(address)}: the Ray cluster has no live node with an NPU "
                               "resource (Ray counts a node's NPUs through CANN, or give ray start --resources "
                               "'{\"NPU\": N}')", "--ray")
        nodes.sort(key=lambda n: (str(n.get("NodeManagerHostname")), str(n.get("NodeManagerAddress")), n["NodeID"]))
        task = ray.remote(_npu_task)
        launched: dict[Any, tuple[dict[str, Any], tuple[int, int], list[Case]]] = {}
        hosts: dict[str, int] = {}
        for n in nodes:
            count = min(int(n["Resources"]["NPU"]), len(selected))  # (no NPU gets an empty part)
            label = f"{n.get('NodeManagerHostname') or 'node'} {n['NodeID'][:8]}"
            hosts[label] = count
            for i in range(1, count + 1):
                ref = task.options(resources={"NPU": 1}, num_cpus=1, max_retries=0,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                    global_argv, conformance_argv, (i, count), timeout)
                node = {"hostname": n.get("NodeManagerHostname"), "node_id": n["NodeID"],
                        "node_ip": n.get("NodeManagerAddress"), "label": label}
                launched[ref] = (node, (i, count), conformance.shard(selected, i, count))
        bar = _RayProgress(hosts, progress)
        results = _collect(ray, launched, timeout + 60.0, timeout, base, bar)
        bar.close()
    finally:
        ray.shutdown()
    return merge(results)


def _collect(ray: Any, launched: dict[Any, tuple[dict[str, Any], tuple[int, int], list[Case]]], deadline_s: float,
             timeout: float, base: dict[str, Any], bar: _RayProgress) -> list[tuple[str, dict[str, Any]]]:
    """Wait for every task (at most ``deadline_s``); each one's report, or a placeholder."""
    out: list[tuple[str, dict[str, Any]]] = []
    pending = list(launched)
    deadline = time.monotonic() + deadline_s
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(1.0, left))
            for ref in ready:
                node, part, cases = launched[ref]
                try:
                    result = ray.get(ref)
                except Exception as exc:  # the worker or the node died, the task could not run
                    text = str(exc).strip().splitlines()
                    result = {**node, "problem": f"the Ray task failed ({type(exc).__name__}"
                                                 f"{': ' + text[0] if text else ''})"}
                out.append(_report_of(node, part, cases, result, base, timeout, bar))
    finally:
        for ref in pending:  # (also on Ctrl-C: no task outlives the run)
            ray.cancel(ref, force=True)
    for ref in pending:
        node, part, cases = launched[ref]
        result = {**node, "problem": f"no result within --ray-timeout {timeout:g} s and a minute to schedule it"}
        out.append(_report_of(node, part, cases, result, base, timeout, bar))
    return out


def _report_of(node: dict[str, Any], part: tuple[int, int], cases: list[Case], result: dict[str, Any],
               base: dict[str, Any], timeout: float, bar: _RayProgress) -> tuple[str, dict[str, Any]]:
    for key in ("hostname", "node_id", "node_ip"):
        result.setdefault(key, node.get(key))
    npu = result.get("host_device")
    where = f"ray task on {result.get('hostname')} node {str(result.get('node_id'))[:8]} " \
            f"NPU {'?' if npu is None else npu} (part {part[0]}/{part[1]})"
    report = result.get("report")
    if report is not None:
        try:
            report = check_report(report, where)
        except ClusterError as exc:
            report, result["problem"] = None, f"its report: {exc}"
    if report is None:
        report = _placeholder(result, base, cases, _why(result, timeout))
    else:
        report = dict(report, host=result.get("hostname") or report.get("host"), node_id=result.get("node_id"),
                      node_ip=result.get("node_ip"))
    failing = sum(_failing(c, bool(report.get("strict"))) for c in report["cases"])
    state = report["problems"][0] if report.get("problems") else f"{len(report['cases'])} cases, {failing} failing"
    bar.step(node["label"], f"{where}: {state}", len(report["cases"]), failing)
    return where, report


def ray_command(args: Any, selected: list[Case], profile: str) -> int:
    """``pyacl-moe conformance --ray``: the flags the tasks' runs take from this one, the run,
    the table and the reports; the exit status."""
    for flag, value in (("--device", args.device), ("--devices", args.devices), ("--baseline", args.baseline),
                        ("--report-csv", args.report_csv)):
        if value is not None:
            why = "each task runs on the NPU Ray gives it" if flag.startswith("--device") else \
                "is a single host's; merge writes --report and --junit"
            raise ClusterError(f"cannot be given with --ray: {why}", flag)
    global_argv = ["--emulator"] if args.emulator else []
    argv = ["--full"] if args.full else []
    if args.filter:
        argv.append(f"--filter={args.filter}")
    argv += [f"--seed={args.seed}", f"--perf={args.perf}"]
    standard = "exact" if args.exact else args.standard
    if standard:
        argv.append(f"--standard={standard}")
    for flag, items in (("--rtol", args.rtol), ("--atol", args.atol)):
        for dtype, value in dict(pair for item in items or [] for pair in item).items():
            argv.append(f"{flag}={dtype}={value!r}")
    if args.strict:
        argv.append("--strict")
    if args.max_memory is not None:
        argv.append(f"--max-memory={args.max_memory}")
    if args.ascend_home is not None:
        argv.append(f"--ascend-home={args.ascend_home}")
    for path in args.cases or []:
        argv.append(f"--cases={path}")
    rtol = dict(pair for item in args.rtol or [] for pair in item)
    atol = dict(pair for item in args.atol or [] for pair in item)
    base = {"profile": profile, "seed": args.seed, "standard": standard or conformance.DEFAULT_STANDARD,
            "strict": bool(args.strict), "selection": conformance.selection(profile, args.filter, selected),
            "standards": {k: {"rtol": v.rtol, "atol": v.atol, "max_share": v.max_share}
                          for k, v in conformance.standards(rtol, atol).items()},
            "pyacl_moe": __version__}
    merged = run_on_ray(args.ray, global_argv, argv, selected, base, timeout=args.ray_timeout, progress=sys.stderr)
    print(table(merged))
    _write(merged, args.report, args.junit)
    status: int = merged["exit_status"]
    return status
