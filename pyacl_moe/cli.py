"""The ``pyacl-moe`` command: argparse in front of the package, no logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from . import __version__


def _info(args: argparse.Namespace) -> int:
    import pyacl_moe as pm

    lib = pm.library_info()
    major, minor, patch = pm.acl_version()
    count = pm.device_count()
    report: dict[str, Any] = {
        "pyacl_moe": __version__,
        "backend": lib.backend,
        "home": lib.home,
        "libraries": lib.paths,
        "acl_version": f"{major}.{minor}.{patch}",
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
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"pyacl-moe {__version__}")
    print(f"backend      {lib.backend}" + (f" ({report['emulator']})" if "emulator" in report else ""))
    print(f"home         {lib.home or '(dynamic loader path)'}")
    for name, path in lib.paths.items():
        print(f"lib{name + '.so':<13}{path}")
    print(f"ACL version  {report['acl_version']}")
    print(f"SoC          {report['soc']}")
    print(f"devices      {count}")
    for d in report["devices"]:
        print(f"  device {d['id']}: {d['memory_free'] / 2**30:.2f} GiB free of {d['memory_total'] / 2**30:.2f} GiB")
    return 0


def _run(args: argparse.Namespace) -> int:
    import pyacl_moe as pm

    from .tools.cases import compare, make_case

    case = make_case(
        args.tokens, args.top_k, args.hidden, args.dtype, args.mode,
        active_num=args.active_num, experts=args.experts, capacity=args.capacity, seed=args.seed,
    )
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
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"aclnnMoeInitRoutingV2Grad on {result['backend']} device {dev.device_id}: {case.scenario}, {args.dtype}")
        print(f"  grad_expanded_x  {tuple(case.grad_expanded_x.shape)}")
        print(f"  expanded_row_idx {tuple(case.expanded_row_idx.shape)}  top_k={case.top_k} "
              f"drop_pad_mode={case.drop_pad_mode} active_num={case.active_num}")
        print(f"  out              {tuple(got.shape)}")
        print(f"  time             {elapsed * 1e3:.3f} ms (NumPy in, NumPy out)")
        print(f"  max abs error    {cmp.max_abs_error:.3g}  max rel error {cmp.max_rel_error:.3g}  "
              f"(tolerance rtol={cmp.rtol:g} atol={cmp.atol:g})")
        verdict = "PASS" if cmp.passed else f"FAIL: {cmp.mismatches} of {cmp.elements} elements outside tolerance"
        print(f"  result           {verdict}")
    return 0 if cmp.passed else 1


def _conformance(args: argparse.Namespace) -> int:
    from .tools import conformance

    report = conformance.run("full" if args.full else "quick", args.filter, args.seed)
    print(report.table())
    if args.report:
        report.write_json(args.report)
    if args.junit:
        report.write_junit(args.junit)
    return 0 if report.ok else 1


def _bench(args: argparse.Namespace) -> int:
    from .tools import bench

    log = None if args.json else (lambda msg: print(f"  measuring: {msg}", file=sys.stderr, flush=True))
    res, extra = bench.run(quick=args.quick, log=log)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(bench.report(res, extra))
    return 0


def _emulator(args: argparse.Namespace) -> int:
    from . import emulator

    print(emulator.build(force=getattr(args, "force", False)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyacl-moe",
        description="Drive CANN's aclnnMoeInitRoutingV2Grad from the command line.",
    )
    p.add_argument("--version", action="version", version=f"pyacl-moe {__version__}")
    p.add_argument("--emulator", action="store_true",
                   help="use the bundled CANN emulator instead of an installed CANN")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="which CANN is loaded, from where, and its devices")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_info)

    run = sub.add_parser("run", help="run one random case and check it against the NumPy reference")
    run.add_argument("--tokens", type=int, default=64, help="N, tokens (default 64)")
    run.add_argument("--top-k", type=int, default=4, help="K, experts per token (default 4)")
    run.add_argument("--hidden", type=int, default=256, help="H, hidden size (default 256)")
    run.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float32")
    run.add_argument("--mode", choices=("dropless", "active", "drop-pad"), default="dropless")
    run.add_argument("--active-num", type=int, default=None, help="A, rows in active mode (default N*K/2)")
    run.add_argument("--experts", type=int, default=None, help="E in drop-pad mode (default 8)")
    run.add_argument("--capacity", type=int, default=None, help="C in drop-pad mode (default N*K/E)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", action="store_true", help="print JSON")
    run.set_defaults(func=_run)

    conf = sub.add_parser("conformance", help="check the op against its contract: results, refusals, determinism")
    prof = conf.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="small shapes, under a minute on the emulator (default)")
    prof.add_argument("--full", action="store_true", help="add the large shapes (up to 512 MiB inputs)")
    conf.add_argument("--filter", metavar="SUBSTRING", help="only cases whose name contains SUBSTRING")
    conf.add_argument("--report", metavar="FILE.json", help="write a JSON report")
    conf.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report")
    conf.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    conf.set_defaults(func=_conformance)

    bench = sub.add_parser("bench", help="host cost of each launch path, reference and kernel speed, side by side")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions, 128 MiB cases (under a minute)")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench.set_defaults(func=_bench)

    emu = sub.add_parser("emulator", help="build the bundled emulator or print where it is")
    emu_sub = emu.add_subparsers(dest="emulator_command", required=True)
    b = emu_sub.add_parser("build", help="compile it (cached) and print its home")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.set_defaults(func=_emulator)
    emu_sub.add_parser("path", help="print its home, building first if needed").set_defaults(func=_emulator)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .emulator import EmulatorBuildError
    from .errors import PyaclMoeError

    try:
        if args.emulator:
            from . import use_emulator

            use_emulator()
        return int(args.func(args) or 0)
    except (PyaclMoeError, EmulatorBuildError) as exc:
        print(f"pyacl-moe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
