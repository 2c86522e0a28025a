"""The ``pyacl-moe`` command: argparse in front of the package, no logic of its own."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Any

from . import __version__


def _info(args: argparse.Namespace) -> int:
    import pyacl_moe as pm

    lib = pm.library_info()
    version = pm.cann_version()
    count = pm.device_count()
    applies = version.behaviour
    report: dict[str, Any] = {
        "pyacl_moe": __version__,
        "backend": lib.backend,
        "home": lib.home,
        "toolkit_version": version.toolkit_version,
        "ops_version": version.ops_version,
        "runtime_version": version.runtime_version,
        "acl_version": version.acl_version,
        "op_library": version.op_library,
        "libraries": lib.paths,
        "dependencies": list(lib.dependencies),
        "version_sources": version.sources,
        "expectations": {"since": applies.behaviour.since, "source": applies.behaviour.source,
                         "note": applies.note},
        "device_count": count,
        "devices": [],
    }
    if lib.backend == "emulator":
        report["emulator"] = pm.emulator.version()
    for d in range(count):
        dev = pm.Device(d)
        free, total = dev.mem_info()
        report["devices"].append({"id": d, "memory_free": free, "memory_total": total})
    report["soc"] = pm.soc_name()
    c = pm.device.chip()
    report["chip"] = {"family": c.family, "vector_cores": c.vector_cores, "ub_bytes": c.ub_bytes,
                      "summation": c.summation, "invalid_index": c.invalid_index,
                      "forward_relaxed": c.forward_relaxed}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from .tools.conformance import printable

    def say(line: str) -> None:  # (what the install's files say is shown, never sent to the terminal)
        print(printable(line))

    say(f"pyacl-moe {__version__}")
    say(f"backend      {lib.backend}" + (f" ({report['emulator']})" if "emulator" in report else ""))
    say(f"home         {lib.home or '(dynamic loader path)'}")
    say(f"toolkit      {version.toolkit_version or '(not recorded)'}")
    say(f"ops          {version.ops_version or '(part of the toolkit)'}")
    say(f"runtime      {version.runtime_version or '(not recorded)'}")
    say(f"op library   {version.op_library}")
    width = max(13, *(len(name) + 7 for name in lib.paths))  # a library's name, a space, then its path
    for name, path in lib.paths.items():
        say(f"{'lib' + name + '.so':<{width}}{path}")
    for path in lib.dependencies:
        say(f"{'  needs':<{width}}{path}")
    say(f"ACL version  {report['acl_version']}")
    note = f" ({applies.note})" if applies.note else ""
    say(f"expects      the op of {applies.behaviour.since} and later{note}")
    say(f"SoC          {report['soc']}")
    say(f"chip         {c.describe()}")
    say(f"devices      {count}")
    for d in report["devices"]:
        say(f"  device {d['id']}: {d['memory_free'] / 2**30:.2f} GiB free of {d['memory_total'] / 2**30:.2f} GiB")
    return 0


def _run(args: argparse.Namespace) -> int:
    import pyacl_moe as pm

    from .tools.cases import compare, make_case, too_large, x_shape

    if args.active_num is not None and args.mode != "active":
        raise UsageError(f"applies to --mode active, not {args.mode}", "--active-num")
    for flag, value in (("--experts", args.experts), ("--capacity", args.capacity)):
        if value is not None and args.mode != "drop-pad":
            raise UsageError(f"applies to --mode drop-pad, not {args.mode}", flag)
    if args.active_num is not None and args.active_num > args.tokens * args.top_k:
        raise UsageError(f"must be at most N*K = {args.tokens * args.top_k}, got {args.active_num}", "--active-num")
    sizes = {"tokens": args.tokens, "top_k": args.top_k, "hidden": args.hidden, "mode": args.mode,
             "active_num": args.active_num, "experts": args.experts, "capacity": args.capacity}
    # Refused here, in one line naming the flags, rather than as NumPy's MemoryError from deep
    # inside make_case.
    why = too_large(dtype=args.dtype, **sizes)
    if why:
        shape = x_shape(**sizes)  # the values --active-num, --experts and --capacity default to
        named = {"--tokens": args.tokens, "--top-k": args.top_k, "--hidden": args.hidden,
                 **{"dropless": {}, "active": {"--active-num": shape[0]},
                    "drop-pad": {"--experts": shape[0], "--capacity": shape[1]}}[args.mode]}
        raise UsageError(f"{'/'.join(map(str, named.values()))} ({args.mode}, {args.dtype}): {why}", "/".join(named))
    case = make_case(dtype=args.dtype, seed=args.seed, **sizes)
    dev = pm.current_device()
    # The first call loads and warms up; time the second, which is what a loop would see.
    pm.moe_init_routing_v2_grad(*case.args())
    t0 = time.perf_counter()
    got = pm.moe_init_routing_v2_grad(*case.args())
    elapsed = time.perf_counter() - t0
    want = pm.reference.moe_init_routing_v2_grad(*case.args())
    cmp = compare(got, want, case.grad_expanded_x.dtype)
    result = {
        "backend": pm.library_info().backend,
        "device": dev.device_id,
        "scenario": case.scenario,
        "dtype": args.dtype,
        "top_k": case.top_k,
        "drop_pad_mode": case.drop_pad_mode,
        "active_num": case.active_num,
        "grad_expanded_x_shape": list(case.grad_expanded_x.shape),
        "expanded_row_idx_shape": list(case.expanded_row_idx.shape),
        "out_shape": list(got.shape),
        "seconds": elapsed,
        **cmp.as_dict(),
    }
    result["share_outside"] = cmp.share
    result["verdict"] = cmp.verdict()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"aclnnMoeInitRoutingV2Grad on {result['backend']} device {dev.device_id}: {case.scenario}, {args.dtype}")
        print(f"  grad_expanded_x  {tuple(case.grad_expanded_x.shape)}")
        print(f"  expanded_row_idx {tuple(case.expanded_row_idx.shape)}  top_k={case.top_k} "
              f"drop_pad_mode={case.drop_pad_mode} active_num={case.active_num}")
        print(f"  out              {tuple(got.shape)}")
        print(f"  time             {elapsed * 1e3:.3f} ms (NumPy in, NumPy out)")
        # The verdict states the criterion itself; the raw figures follow, labelled, because a
        # relative error near a zero expected value can be large while atol covers it.
        print(f"  result           {'PASS' if cmp.passed else 'FAIL'}: {cmp.verdict()}")
        print(f"  errors           max abs {cmp.max_abs_error:.3g}, max rel {cmp.max_rel_error:.3g} (relative to "
              f"|expected|; an element is within tolerance when |error| <= atol + rtol*|expected|)")
    return 0 if cmp.passed else 1


class UsageError(Exception):
    """A bad flag value or an environment that cannot run: exit 2 before any case runs.

    With ``flag``, the value of that flag (or of that pair, "--rtol/--atol") is what is wrong:
    main reports it as argparse reports a value it refuses itself, so that every refused
    value reads the same whichever check found it."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


def _conformance(args: argparse.Namespace) -> int:
    from .tools import conformance
    from .tools.cases import size_text

    # Each item gave (dtype, value) pairs; a later item wins.
    rtol = dict(pair for item in args.rtol or [] for pair in item)
    atol = dict(pair for item in args.atol or [] for pair in item)
    max_memory = args.max_memory
    if args.exact and args.standard not in (None, "exact"):
        raise UsageError(f"is --standard exact; it cannot be given with --standard {args.standard}", "--exact")
    standard = "exact" if args.exact else args.standard or conformance.DEFAULT_STANDARD
    if (rtol or atol) and standard != "pyacl":
        raise UsageError(f"override the pyacl standard's tolerances; the {standard} standard "
                         f"has its own (docs/conformance.md): give --standard pyacl", "--rtol/--atol")
    devices = args.devices if args.devices is not None else [args.device] if args.device is not None else None
    if args.ascend_home is not None and args.emulator:
        raise UsageError("--ascend-home and --emulator choose different CANNs; give one", "--ascend-home")
    profile = "full" if args.full else "quick"
    kit_cases = None
    if args.cases and devices and len(devices) > 1:
        raise UsageError("--cases runs on one device; give --device, not --devices", "--devices")
    # A flag that would change nothing is refused, not ignored: the run would not be the one asked for.
    if args.cases and (args.full or args.quick):
        raise UsageError("picks a profile of the catalogue; --cases runs the case files' rows instead, every one "
                         "(narrow them with --filter)", "--full" if args.full else "--quick")
    if args.perf_threshold is not None and not (args.baseline and args.perf):
        raise UsageError("compares device times with a baseline's: give it with --baseline OLD.json and --perf N",
                         "--perf-threshold")
    if args.cases:
        from .tools import kitcases

        try:
            # An ATK file's cases are judged by the standard it names, unless one is given here.
            kit_cases = kitcases.load(args.cases, own_standards=not (args.exact or args.standard))
        except kitcases.CaseFileError as exc:
            raise UsageError(str(exc), "--cases") from None
        profile = "cases"
    selected = conformance.select(profile, args.filter, kit_cases)
    if not selected:
        raise UsageError(f"{args.filter!r} matches no case of the {profile} profile "
                         f"(see conformance --list{' --full' if args.full else ''})", "--filter")
    if args.shard is not None:
        if args.shard[1] > len(selected):
            raise UsageError(f"{args.shard[0]}/{args.shard[1]}: {len(selected)} case(s) are selected, too few for "
                             f"{args.shard[1]} parts", "--shard")
        if args.ray is not None:
            raise UsageError("--ray gives each NPU its part of the cases itself; give one of the two", "--shard")
        if args.list:
            selected = conformance.shard(selected, *args.shard)
    if args.list:
        _list_cases(selected)
        return 0
    for flag, path in (("--report", args.report), ("--junit", args.junit), ("--report-csv", args.report_csv)):
        if path:
            _check_writable(flag, path)
    baseline = None
    if args.baseline:
        try:
            baseline = conformance.load_baseline(args.baseline)
        except ValueError as exc:
            raise UsageError(str(exc), "--baseline") from None
        if baseline.get("seed", args.seed) != args.seed:
            raise UsageError(f"{args.baseline} was made with --seed {baseline['seed']}, this run uses "
                             f"{args.seed}: the inputs differ, so would every bit; pass --seed {baseline['seed']}",
                             "--baseline")
    if max_memory is not None and all(c.nbytes > max_memory for c in selected):
        raise UsageError(f"{size_text(max_memory)} leaves no case to run (the smallest needs "
                         f"{size_text(min(c.nbytes for c in selected))})", "--max-memory")
    if args.ray is not None:
        from .tools import cluster

        try:
            return cluster.ray_command(args, selected, profile)
        except cluster.ClusterError as exc:
            raise UsageError(str(exc), exc.flag) from None

    import pyacl_moe as pm

    try:
        if args.ascend_home is not None:
            if not os.path.isdir(args.ascend_home):
                raise UsageError(f"{args.ascend_home}: no such folder", "--ascend-home")
            try:
                pm.load(ascend_home=args.ascend_home, emulator=False)
            except RuntimeError as exc:  # another CANN is loaded already (a library caller)
                raise UsageError(f"{args.ascend_home}: {exc}", "--ascend-home") from None
        count = pm.device_count()
    except pm.CannNotFoundError as exc:
        if args.ascend_home is not None:  # the one home asked for: what is wrong with it, in one line
            raise UsageError("; ".join(exc.tried), "--ascend-home") from None
        # One line for a CI log: where it looked, and the three ways out.
        places = "; ".join(t.split(":")[0] for t in exc.tried)
        raise UsageError(f"no CANN found (looked at {places}): source <toolkit>/set_env.sh, pass --ascend-home "
                         f"PATH, or use --emulator") from None
    unknown = [d for d in devices if not 0 <= d < count] if devices else []
    if unknown:
        raise UsageError(f"device {unknown[0]} does not exist: CANN sees {count} device(s), ids 0 to {count - 1}",
                         "--devices" if args.devices is not None else "--device")

    report = conformance.run(
        profile, args.filter, args.seed, progress=sys.stderr, cases=kit_cases, devices=devices, standard=standard,
        strict=args.strict, rtol=rtol, atol=atol, max_memory=max_memory, baseline=baseline,
        baseline_path=args.baseline or "", perf=args.perf,
        perf_threshold=1.2 if args.perf_threshold is None else args.perf_threshold, part=args.shard,
    )
    print(report.table())
    try:
        if args.report:
            report.write_json(args.report)
        if args.junit:
            report.write_junit(args.junit)
        if args.report_csv:
            report.write_csv(args.report_csv)
    except OSError as exc:
        raise UsageError(f"cannot write the report: {exc}") from None
    return 0 if report.ok else 1


def _list_cases(selected: list[Any]) -> None:
    from .tools.cases import size_text
    from .tools.conformance import printable

    rows = [("case", "kind", "dtype", "scenario", "shape", "source", "memory")]
    for c in selected:
        mem = size_text(c.nbytes) if c.nbytes else "-"
        rows.append((printable(c.name), c.kind, c.dtype, c.scenario, printable(c.shape or "-"), c.source, mem))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print(f"{len(selected)} cases")


def _tolerance(text: str) -> list[tuple[str, float]]:
    """An argparse type for ``[DTYPE=]VALUE``: (dtype, value) pairs, every dtype's for a VALUE alone."""
    from .tools.cases import STANDARDS

    name, sep, number = text.rpartition("=")
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text}: the value must be a finite number >= 0")
    if sep and name not in STANDARDS:
        raise argparse.ArgumentTypeError(f"{text}: the dtype must be one of {', '.join(STANDARDS)}")
    return [(name, value)] if sep else [(dt, value) for dt in STANDARDS]


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """An argparse type: bytes from '512M', '1.5GiB', '4096' (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text}: give a size such as 4096, 512M or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _shard(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N``, the I-th (from 1) of N parts."""
    m = re.fullmatch(r"([0-9]{1,9})/([0-9]{1,9})", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"{text}: give I/N, the I-th of N parts, with 1 <= I <= N (e.g. 2/4)")
    return int(m.group(1)), int(m.group(2))


def _merge(args: argparse.Namespace) -> int:
    from .tools import cluster

    for flag, path in (("--report", args.report), ("--junit", args.junit)):
        if path:
            _check_writable(flag, path)
    try:
        return cluster.merge_command(args.reports, args.report, args.junit)
    except cluster.ClusterError as exc:
        raise UsageError(str(exc), exc.flag) from None


def _device_ids(text: str) -> list[int]:
    """An argparse type: distinct device ids, comma-separated."""
    try:
        ids = [int(v) for v in text.split(",")]
    except ValueError:
        ids = [-1]
    if min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{text}: give distinct non-negative device ids separated by commas")
    return ids


def _integer(lo: int) -> Any:
    """An argparse type: an integer >= lo (argparse names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    return parse


def _ratio(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _check_writable(flag: str, path: str) -> None:
    """Open the file for appending, as the run will write it, and remove it again if it did not
    exist: the only test that answers for permissions, full file systems and missing folders."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: the folder {folder} does not exist", flag)
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{path}: not writable ({exc.strerror or exc})", flag) from None
    if not existed:
        os.unlink(path)


def _bench(args: argparse.Namespace) -> int:
    from .tools import bench

    log = None if args.json else (lambda msg: print(f"  measuring: {msg}", file=sys.stderr, flush=True))
    res, extra = bench.run(quick=args.quick, log=log)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(bench.report(res, extra, quick=args.quick))
    # --quick leaves out the targets its sizes cannot show (bench.QUICK_UNJUDGED).
    return 0 if bench.targets_met(res, quick=args.quick) else 1


def _emulator(args: argparse.Namespace) -> int:
    from . import emulator

    print(emulator.build(force=getattr(args, "force", False)))
    return 0


class _HELP(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", but only where there is a default to state and the help does
    not state it already: not "(default: False)" on a flag, nor "(default: None)" on an option
    whose help says what its absence means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _name_subcommands(sub: Any) -> None:
    """Let a missing subcommand be reported by its choices ("required: {build,path}"), not by
    the dest nobody types ("required: emulator_command"); the usage line reads the same."""
    sub.metavar = "{" + ",".join(sub.choices) + "}"


class _Parser(argparse.ArgumentParser):
    """One line on a usage error, like every other error of the command."""

    def error(self, message: str) -> Any:
        self.exit(2, self.error_line(message))

    def error_line(self, message: str) -> str:
        return f"{self.prog}: error: {message} (see {self.prog} --help)\n"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pyacl-moe",
        description="Drive CANN's aclnnMoeInitRoutingV2Grad from the command line.",
        formatter_class=_HELP,
    )
    p.add_argument("--version", action="version", version=f"pyacl-moe {__version__}")
    p.add_argument("--emulator", action="store_true",
                   help="use the bundled CANN emulator instead of an installed CANN")
    sub = p.add_subparsers(dest="command", required=True)
    # --emulator is taken after the subcommand too (`pyacl-moe run --emulator`); SUPPRESS keeps
    # the subcommand from resetting a --emulator given before it.
    emulator_flag: dict[str, Any] = {"action": "store_true", "default": argparse.SUPPRESS,
                                     "help": "use the bundled CANN emulator instead of an installed CANN"}

    info = sub.add_parser("info", help="which CANN is loaded, from where, and its devices", formatter_class=_HELP)
    info.add_argument("--emulator", **emulator_flag)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)

    run = sub.add_parser("run", help="run one random case and check it against the NumPy reference",
                         formatter_class=_HELP)
    run.add_argument("--emulator", **emulator_flag)
    run.add_argument("--tokens", type=_integer(1), default=64, help="N, tokens")
    run.add_argument("--top-k", type=_integer(1), default=4, help="K, experts per token")
    run.add_argument("--hidden", type=_integer(1), default=256, help="H, hidden size")
    run.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float32", help="element type")
    run.add_argument("--mode", choices=("dropless", "active", "drop-pad"), default="dropless", help="scenario")
    run.add_argument("--active-num", type=_integer(1), default=None,
                     help="A, rows in active mode, at most N*K (default: N*K/2)")
    run.add_argument("--experts", type=_integer(1), default=None, help="E in drop-pad mode (default: 8)")
    run.add_argument("--capacity", type=_integer(1), default=None,
                     help="C in drop-pad mode (default: N*K/E)")
    run.add_argument("--seed", type=_integer(0), default=0, help="seed of the random inputs")
    run.add_argument("--json", action="store_true", help="print JSON")
    run.set_defaults(func=_run)

    conf = sub.add_parser("conformance", help="check the op against its contract: results, refusals, determinism",
                          formatter_class=_HELP,
                          description="Run the conformance catalogue. Exit status: 0 every case passed; 1 the op "
                                      "failed a case (or a case could not run); 2 a usage or environment error, "
                                      "found before any case runs. See docs/conformance.md.")
    conf.add_argument("--emulator", **emulator_flag)
    prof = conf.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="small shapes, under a minute on the emulator (default)")
    prof.add_argument("--full", action="store_true",
                      help="add the large shapes: inputs up to 1 GiB (float32, 8192 tokens x K=8 x H=4096), "
                           "about 3.5 GB of host memory; see docs/conformance.md for its time")
    conf.add_argument("--list", action="store_true", help="list the cases (name, kind, dtype, scenario, shape, "
                                                          "source, memory) and exit; needs no CANN")
    conf.add_argument("--filter", metavar="SUBSTRING", help="only cases whose name contains SUBSTRING")
    conf.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    conf.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")
    conf.add_argument("--cases", action="append", metavar="FILE.csv|FILE.json",
                      help="run the rows of a case file of the vendor's operator test kit, CSV or ATK JSON (either "
                           "op), instead of the catalogue; repeatable (see docs/conformance.md)")
    conf.add_argument("--report-csv", metavar="FILE.csv",
                      help="write one row per case, as the vendor's test kit does (standard, metrics, times, memory)")
    conf.add_argument("--perf", type=_integer(0), default=0, metavar="N",
                      help="run each passing case N more times, timed: the medians of the op call's host time "
                           "(api_us) and device time (device_us) go in the reports")
    conf.add_argument("--perf-threshold", type=_ratio, metavar="RATIO",
                      help="with --baseline and --perf: list the cases whose device_us grew beyond RATIO times "
                           "the baseline's; listed, the exit status does not change (default 1.2)")
    conf.add_argument("--seed", type=_integer(0), default=0, help="seed of the random inputs, >= 0")
    devs = conf.add_mutually_exclusive_group()
    devs.add_argument("--device", type=_integer(0), metavar="N", help="run on device N (default: device 0)")
    devs.add_argument("--devices", type=_device_ids, metavar="N,M,...",
                      help="spread the cases over these devices, one process each, in parallel; one report")
    conf.add_argument("--ascend-home", metavar="PATH", help="load CANN from this toolkit home (what set_env.sh "
                                                           "exports as ASCEND_HOME_PATH)")
    conf.add_argument("--standard", choices=("stat-rel-err", "mixed", "close", "exact", "pyacl"),
                      help="the precision standard numeric results are judged by (default: stat-rel-err, the "
                           "one the vendor judges this op by; see docs/conformance.md)")
    conf.add_argument("--exact", action="store_true", help="the same as --standard exact: bit for bit against "
                                                           "the reference (any NaN matches any NaN)")
    conf.add_argument("--rtol", action="append", type=_tolerance, metavar="[DTYPE=]VALUE",
                      help="with --standard pyacl: override a dtype's rtol, e.g. bfloat16=0.01 (no DTYPE: every "
                           "dtype); repeatable")
    conf.add_argument("--atol", action="append", type=_tolerance, metavar="[DTYPE=]VALUE",
                      help="override atol, as --rtol")
    conf.add_argument("--strict", action="store_true",
                      help="fail the run when CANN differs from a rule inferred from the opbase source")
    conf.add_argument("--max-memory", type=_size, metavar="SIZE",
                      help="skip cases whose inputs and outputs exceed SIZE on the device (e.g. 512M, 2G)")
    conf.add_argument("--baseline", metavar="OLD.json",
                      help="a report of an earlier run: list the cases whose output bits changed and those "
                           "that went from pass to fail")
    conf.add_argument("--shard", type=_shard, metavar="I/N",
                      help="run only the I-th of N disjoint parts of the selected cases (1 <= I <= N; together the "
                           "parts are exactly the selection, the same for the same selection); merge joins the "
                           "parts' reports")
    conf.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                      help="run on a Ray cluster (ADDRESS, or auto: the one this machine belongs to): one task per "
                           "NPU, each host's NPUs sharing the selected cases, one report per host, merged as merge "
                           "does (needs pip install 'pyacl-moe[ray]')")
    conf.add_argument("--ray-timeout", type=_ratio, default=3600, metavar="SECONDS",
                      help="with --ray: the longest one NPU's task may take; a task still running then is stopped "
                           "and its cases reported as errors")
    conf.set_defaults(func=_conformance)

    merge = sub.add_parser("merge", help="join conformance reports of several hosts and devices into one verdict",
                           formatter_class=_HELP,
                           description="Join the JSON reports of conformance runs (hosts, devices, --shard parts) "
                                       "of the same catalogue, seed and standard. Exit status: 0 every case passed "
                                       "and hosts of the same chip and release gave the same output bits; 1 a case "
                                       "failed or outputs differ between such hosts; 2 a host could not run (cases "
                                       "not run) or the reports cannot be merged. See docs/conformance.md.")
    merge.add_argument("reports", nargs="+", metavar="REPORT.json", help="reports written by conformance --report")
    merge.add_argument("--report", metavar="FILE.json", help="write the merged JSON report")
    merge.add_argument("--junit", metavar="FILE.xml", help="write JUnit XML, one testsuite per host")
    merge.set_defaults(func=_merge)

    bench = sub.add_parser("bench", help="host cost of each launch path, reference and kernel speed, side by side",
                           description="Exit status: 0 every judged target met, 1 a target missed (see "
                                       "BENCHMARKS.md). --quick judges only the targets its sizes can show.",
                           formatter_class=_HELP)
    bench.add_argument("--emulator", **emulator_flag)
    bench.add_argument("--quick", action="store_true",
                       help="fewer repetitions, 128 MiB cases (under a minute); the reference's target is "
                            "reported, not judged")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench.set_defaults(func=_bench)

    emu = sub.add_parser("emulator", help="build the bundled emulator or print where it is", formatter_class=_HELP)
    emu_sub = emu.add_subparsers(dest="emulator_command", required=True)
    b = emu_sub.add_parser("build", help="compile it (cached) and print its home", formatter_class=_HELP)
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.set_defaults(func=_emulator)
    emu_sub.add_parser("path", help="print its home, building first if needed",
                       formatter_class=_HELP).set_defaults(func=_emulator)
    _name_subcommands(emu_sub)
    _name_subcommands(sub)
    # Each command's own parser, to report a UsageError naming a flag as argparse would.
    for parser in (*sub.choices.values(), *emu_sub.choices.values()):
        parser.set_defaults(parser=parser)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .emulator import EmulatorBuildError, announce_builds
    from .errors import PyaclMoeError

    quiet = getattr(args, "json", False)  # (stdout is the JSON; stderr stays quiet too)
    try:
        if quiet:
            announce_builds(False)
        if args.emulator:
            from . import use_emulator

            use_emulator()
        return int(args.func(args) or 0)
    except UsageError as exc:
        if exc.flag:  # in the words of argparse's own refusals
            sys.stderr.write(args.parser.error_line(f"argument {exc.flag}: {exc}"))
        else:
            print(f"pyacl-moe: error: {exc}", file=sys.stderr)
        return 2
    except (PyaclMoeError, EmulatorBuildError) as exc:
        print(f"pyacl-moe: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        # A size the up-front check let through (it refuses only the certain cases) and the
        # allocation then refused: one line, not NumPy's traceback.
        print(f"pyacl-moe: error: out of memory: {exc}; give smaller sizes", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyacl-moe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (``| head``): nothing more to say, and no traceback at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        if quiet:
            announce_builds(True)  # (main may run in a caller's process: the default again)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
