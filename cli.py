"""The ``plan`` command line. Every input error ends in one message on stderr
and exit code 2; a failed ``--check`` exits 1."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import AttnplanError, PlanError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too; we keep it short)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _batch_args(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seqlens", help="comma-separated sample lengths, e.g. 4096,1000,300")
    src.add_argument("--batch", help="batch file (JSON or JSONL) or FILE:NAME for one line of a JSONL file")


def _load_batch(args):
    from .frontend import load_batch, parse_seqlens
    if args.seqlens is not None:
        return parse_seqlens(args.seqlens), None
    b = load_batch(args.batch)
    return b.seqlens, b.segments


def _shape_args(p, nodes: bool = True):
    """Model and machine shape options shared by compile-like commands."""
    if nodes:
        p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--profile", default="h100", help="cost profile: h100, a100, cpu-local, or FILE.json")


def _strategy_list(text: str) -> list[str]:
    from .passes import strategies
    if text == "all":
        return list(strategies())
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in strategies()]
    if unknown or not names:
        raise PlanError(f"unknown strategy {', '.join(unknown) or text!r}; known: {', '.join(strategies())}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="plan", description="attnplan: compile, inspect and run distributed attention plans")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    c = sub.add_parser("compile", help="compile a batch and a mask into a plan file")
    _batch_args(c)
    c.add_argument("--mask", default="causal", help="builtin name, mask expression, or FILE.mask (default: causal)")
    c.add_argument("--devices", type=int, required=True)
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--heads", type=int, default=8)
    c.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    c.add_argument("--head-dim", type=int, default=64)
    c.add_argument("--block-size", type=int, default=2048)
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    c.add_argument("--memory-cap", type=int, default=None, help="bytes of buffers per device and phase")
    c.add_argument("--profile", default="h100", help="cost profile for predicted times (h100, a100, cpu-local)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--strategy", default="zigzag")
    g.add_argument("--pipeline", help="pass pipeline, e.g. 'tile{block=1024},zigzag,comm,emit'")
    c.add_argument("--no-verify", action="store_true", help="skip the verifier between passes")
    c.add_argument("-v", "--verbose", action="store_true", help="print each pass and its time")
    c.add_argument("-o", "--output", required=True, help="plan file to write")

    s = sub.add_parser("stats", help="statistics of a plan")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.add_argument("--profile", default=None)

    r = sub.add_parser("run", help="execute a plan on CPU: in this process, or one process per device (--procs)")
    r.add_argument("plan")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    r.add_argument("--check", action="store_true", help="compare outputs and gradients with dense masked attention")
    r.add_argument("--devices", type=int, default=None, help="expected device count (error if the plan differs)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--procs", type=int, default=None,
                   help="run on N local processes (gloo), one per device; under torchrun (RANK and WORLD_SIZE set) "
                        "this process runs as that rank")
    r.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a transfer may take before the run fails naming the peer (multi-process runs)")

    sh = sub.add_parser("show", help="text form of a plan's programs")
    sh.add_argument("plan")
    sh.add_argument("--device", type=int, default=None)
    sh.add_argument("--level", default="program", choices=["program", "all"])

    cp = sub.add_parser("compare", help="compile several strategies on one batch, side by side")
    _batch_args(cp)
    cp.add_argument("--mask", default="causal")
    cp.add_argument("--devices", type=int, required=True)
    _shape_args(cp)
    cp.add_argument("--strategies", default="all", help="comma-separated strategy names, or all")
    cp.add_argument("--json", action="store_true")
    cp.add_argument("--html", default=None, help="write the visual comparison report to this file")

    bn = sub.add_parser("bench", help="every strategy over a workload file: table, JSON, plots")
    bn.add_argument("--batches", default=None, help="JSONL of batches (default: ../shared/workloads/batches.jsonl)")
    bn.add_argument("--names", default=None, help="comma-separated batch names to keep")
    bn.add_argument("--masks", default="causal", help="masks separated by ';', e.g. 'causal;streaming(64,4096)'")
    bn.add_argument("--devices", default="8,32", help="comma-separated device counts (8 devices a node)")
    bn.add_argument("--strategies", default="all")
    _shape_args(bn, nodes=False)
    bn.add_argument("--out", default="out/bench", help="folder for bench.json, summary.txt and PNG plots")
    bn.add_argument("--no-progress", action="store_true")

    cal = sub.add_parser("calibrate", help="measure this machine's kernel and gloo rates into a cost profile")
    cal.add_argument("-o", "--output", default="cpu-calibrated.json")
    cal.add_argument("--repeats", type=int, default=5)

    m = sub.add_parser("mask", help="ASCII picture of a mask over a small batch")
    m.add_argument("mask")
    _batch_args(m)
    m.add_argument("--width", type=int, default=64)

    vz = sub.add_parser("viz", help="visual report of a plan: one self-contained HTML file and/or PNG pictures")
    vz.add_argument("plan")
    vz.add_argument("-o", "--output", default=None, help="HTML report to write, e.g. report.html")
    vz.add_argument("--png", default=None, metavar="DIR", help="write mask/bars/comm/timeline PNGs into DIR")
    vz.add_argument("--profile", default=None, help="cost profile for the timeline (default: the plan's)")

    ex = sub.add_parser("explain", help="short text account: most loaded device and why, transfers, waits, cost")
    ex.add_argument("plan")
    ex.add_argument("--device", type=int, default=None, help="explain this device (default: the most loaded)")
    ex.add_argument("--profile", default=None)
    return ap


def _cmd_compile(args) -> int:
    from .api import compile as compile_plan
    seqlens, segments = _load_batch(args)

    def show(p, ir, dt):
        print(f"  {p.spec():<40} {dt * 1e3:9.1f} ms", file=sys.stderr)

    plan = compile_plan(seqlens=seqlens, segments=segments, mask=args.mask, devices=args.devices, nodes=args.nodes,
                        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, strategy=args.strategy,
                        block_size=args.block_size, pipeline=args.pipeline, dtype=args.dtype,
                        memory_cap=args.memory_cap, verify=not args.no_verify, profile=args.profile,
                        instruments=(show,) if args.verbose else ())
    try:
        plan.save(args.output)
    except OSError as e:
        raise PlanError(f"{args.output}: cannot write plan file: {e.strerror or e}") from None
    s = plan.stats()
    print(f"wrote {args.output}: {s['devices']} devices, {s['tokens']} tokens, compute imbalance "
          f"{s['compute_imbalance']:.3f}, comm {s['comm_bytes_total'] / 1e6:.2f} MB, predicted "
          f"{s['predicted_s'] * 1e3:.3f} ms, planned in {s['plan_s']:.3f} s")
    return 0


def _cmd_stats(args) -> int:
    from .api import load
    from .backends.stats import format_stats
    s = load(args.plan).stats(args.profile)
    print(json.dumps(s, indent=2) if args.json else format_stats(s))
    return 0


def _cmd_run(args) -> int:
    import os

    from .api import load
    from .runtime import launch
    from .runtime.check import check_plan, run_plan
    if not args.timeout > 0:
        raise PlanError(f"--timeout must be positive seconds, got {args.timeout}")
    if launch.in_rank_mode():  # torchrun, or a process started by --procs
        if args.procs is not None and str(args.procs) != os.environ["WORLD_SIZE"]:
            raise PlanError(f"--procs {args.procs} differs from WORLD_SIZE={os.environ['WORLD_SIZE']}")
        if args.devices is not None and str(args.devices) != os.environ["WORLD_SIZE"]:
            raise PlanError(f"--devices {args.devices} differs from WORLD_SIZE={os.environ['WORLD_SIZE']}")
        return launch.run_rank(args.plan, args.dtype, args.seed, args.check, args.timeout)
    plan = load(args.plan)
    if args.devices is not None and args.devices != plan.devices:
        raise PlanError(f"{args.plan} was compiled for {plan.devices} devices, not {args.devices}")
    if args.procs is not None:
        if args.procs != plan.devices:
            raise PlanError(f"{args.plan} was compiled for {plan.devices} devices; --procs must be {plan.devices}, "
                            f"got {args.procs}")
        return launch.launch([str(args.plan), "--dtype", args.dtype, "--seed", str(args.seed), "--timeout",
                              repr(args.timeout)] + (["--check"] if args.check else []), args.procs)
    t0 = time.perf_counter()
    if not args.check:
        run_plan(plan, args.dtype, args.seed)
        print(f"ran {plan.devices} devices forward+backward in {time.perf_counter() - t0:.2f} s")
        return 0
    r = check_plan(plan, args.dtype, args.seed)
    for name in ("out", "dq", "dk", "dv"):
        print(f"{name:>4}: max abs error {r[name]:.3e} (tolerance {r['tol'][name]:.1e})")
    print(f"{'PASS' if r['ok'] else 'FAIL'}: {plan.devices} devices, {plan.problem.tokens} tokens, {args.dtype}, "
          f"{time.perf_counter() - t0:.2f} s")
    return 0 if r["ok"] else 1


def _cmd_show(args) -> int:
    from .api import load
    plan = load(args.plan)
    if args.level == "all":
        if args.device is not None:
            plan.to_text(args.device)  # validates the device
        ir = plan.ir
        print(ir.problem.to_text())
        print(ir.graph.to_text())
        print(ir.placement.to_text())
        print(ir.schedule.to_text())
    sys.stdout.write(plan.to_text(args.device))
    return 0


def _cmd_mask(args) -> int:
    from .frontend import load_mask, render
    seqlens, segments = _load_batch(args)
    if args.width <= 0:
        raise PlanError(f"--width must be positive, got {args.width}")
    if sum(seqlens) > 4096:
        raise PlanError(f"plan mask draws small batches (at most 4096 tokens); this one has {sum(seqlens)}")
    print(render(load_mask(args.mask), seqlens, segments, width=args.width))
    return 0


def _cmd_viz(args) -> int:
    from .api import load
    from .backends.viz import render_html, write_pngs
    if args.output is None and args.png is None:
        raise PlanError("plan viz needs -o REPORT.html and/or --png DIR")
    plan = load(args.plan)
    if args.output is not None:
        text = render_html(plan, args.profile)
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise PlanError(f"{args.output}: cannot write report: {e.strerror or e}") from None
        print(f"wrote {args.output} ({len(text.encode()) / 1e6:.2f} MB)")
    if args.png is not None:
        print("wrote " + ", ".join(str(p) for p in write_pngs(plan, args.png, args.profile)))
    return 0


def _cmd_explain(args) -> int:
    from .api import load
    from .backends.explain import explain
    print(explain(load(args.plan), device=args.device, profile=args.profile))
    return 0


def _cmd_compare(args) -> int:
    from .backends.compare import compare, format_rows
    seqlens, segments = _load_batch(args)
    rows, plans = compare(_strategy_list(args.strategies), seqlens=seqlens, segments=segments, mask=args.mask,
                          devices=args.devices, nodes=args.nodes, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype,
                          profile=args.profile)
    if args.html:
        from .backends.viz import render_compare_html
        try:
            with open(args.html, "w") as f:
                f.write(render_compare_html(list(plans.items())))
        except OSError as e:
            raise PlanError(f"{args.html}: cannot write report: {e.strerror}") from None
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows))
        if args.html:
            print(f"wrote {args.html}")
    return 0


def _cmd_bench(args) -> int:
    import os
    from .backends.bench import bench
    path = args.batches or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "workloads",
                                        "batches.jsonl")
    if not os.path.isfile(path):
        raise PlanError(f"batch file not found: {path} (give --batches FILE)")
    try:
        devices = [int(x) for x in args.devices.split(",")]
    except ValueError:
        raise PlanError(f"--devices must be comma-separated integers, got {args.devices!r}") from None
    masks = [m.strip() for m in args.masks.split(";") if m.strip()]
    res = bench(path, masks, devices, _strategy_list(args.strategies), args.out,
                names=args.names.split(",") if args.names else None, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, block_size=args.block_size, profile=args.profile,
                show_progress=not args.no_progress)
    print(res["text"])
    print("wrote " + ", ".join(str(f) for f in res["files"]))
    return 0


def _cmd_calibrate(args) -> int:
    from .runtime.calibrate import write_profile
    prof = write_profile(args.output, args.repeats)
    print(f"wrote {args.output}: kernel {prof['peak_flops'] / 1e9:.1f} GFLOP/s (bf16, 1 thread), launch "
          f"{prof['launch_s'] * 1e6:.1f} us, gloo {prof['intra_bw'] / 1e9:.2f} GB/s, latency "
          f"{prof['intra_alpha'] * 1e6:.0f} us")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cmds = {"compile": _cmd_compile, "stats": _cmd_stats, "run": _cmd_run, "show": _cmd_show, "mask": _cmd_mask,
            "compare": _cmd_compare, "bench": _cmd_bench, "calibrate": _cmd_calibrate, "viz": _cmd_viz,
            "explain": _cmd_explain}
    try:
        return cmds[args.cmd](args)
    except AttnplanError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `plan show x.plan | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
