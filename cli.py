"""The ``plan`` command line. Every input error ends in one message on stderr
and exit code 2; a failed ``--check`` exits 1.

Numbers are checked where argparse reads them, against the stated limits of
``ir/limits.py`` (an out-of-range value is a one-line usage error, exit 2);
an output path is checked before any work starts, and ``-o -`` writes to
standard output (the plan file's bytes, the profile's JSON, the report's
HTML; the one-line summary then goes to stderr)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

from .cli_io import STDOUT, check_output, progress, shows_progress, summary_stream, write_output
from .errors import AttnplanError, PlanError
from .ir import limits
from .passes.comm import COMM_VARIANTS

_VARIANTS = ", ".join(COMM_VARIANTS)  # the comm variants of NAME:VARIANT entries

MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes 0..2^64-1


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # `--device` is not `--devices`: flags are spelled out
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2 (argparse prints usage too; we keep it short)
        self.exit(2, f"{self.prog}: error: {message}\n")


# ------------------------------------------------------------------ argparse types (checked where read)

def _int_in(lo: int, hi: int):
    """An argparse type: an integer in ``lo..hi``."""
    def parse(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", t):
            raise argparse.ArgumentTypeError(f"expected an integer in {lo:,}..{hi:,}, got {text[:40]!r}")
        digits = len(t.lstrip("+-"))
        if digits > 30:  # far outside every range here; int() of >4300 digits would raise
            raise argparse.ArgumentTypeError(f"must be an integer in {lo:,}..{hi:,}, got a {digits}-digit number")
        v = int(t)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo:,}..{hi:,}, got {v:,}")
        return v
    parse.__name__ = "int"
    return parse


def _device_counts(text: str) -> list[int]:
    """An argparse type: comma-separated device counts, each in 1..MAX_DEVICES."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated device counts, e.g. 8,32, got {text[:40]!r}")
    return [_int_in(1, limits.MAX_DEVICES)(p) for p in parts]


def _mask_list(text: str) -> list[str]:
    """An argparse type: masks separated by ';', at least one."""
    masks = [m.strip() for m in text.split(";") if m.strip()]
    if not masks:
        raise argparse.ArgumentTypeError("no mask given (separate masks by ';', e.g. 'causal;sliding_window(512)')")
    return masks


POSITIVE_DEVICES = _int_in(1, limits.MAX_DEVICES)


# ------------------------------------------------------------------ shared options

def _batch_args(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seqlens", help="comma-separated sample lengths, e.g. 4096,1000,300; cross-attention "
                     "samples as QUERIES:KEYS, e.g. 512:64,300:64")
    src.add_argument("--batch", help="batch file (JSON or JSONL) or FILE:NAME for one line of a JSONL file")


def _load_batch(args):
    """The batch of ``--seqlens`` or ``--batch`` (a :class:`attnplan.frontend.Batch`)."""
    from .frontend import load_batch, parse_batch_text
    return parse_batch_text(args.seqlens) if args.seqlens is not None else load_batch(args.batch)


def _shape_args(p, nodes: bool = True,
                profile_help: str = "cost profile: h100 (default), h200, a100, cpu-local, or FILE.json"):
    """Model and machine shape options shared by compile-like commands."""
    if nodes:
        p.add_argument("--nodes", type=POSITIVE_DEVICES, default=1,
                       help="nodes the devices spread over evenly (default 1): links across them are the slow ones")
    p.add_argument("--heads", type=_int_in(1, limits.MAX_HEADS), default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=_int_in(1, limits.MAX_HEADS), default=None, help="default: --heads")
    p.add_argument("--head-dim", type=_int_in(1, limits.MAX_HEAD_DIM), default=64, help="default 64")
    p.add_argument("--block-size", type=_int_in(1, limits.MAX_BLOCK_SIZE), default=2048,
                   help="tokens per block of the tile pass (default 2048)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of Q, K, V (default bfloat16)")
    p.add_argument("--partials-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype partial outputs travel in between devices: float32 (default) or --dtype (half the "
                        "bytes of the backward's partial dK/dV, each partial rounded once)")
    p.add_argument("--keep-kv", action="store_true",
                   help="the backward reuses the K/V each device received in the forward: no KV moves in the "
                        "backward; each device holds what it received until then")
    p.add_argument("--profile", default="h100", help=profile_help)


def _strategy_list(text: str, variants: bool = False, keep_kv: bool = False) -> list[str]:
    """``all`` (every strategy; with ``variants`` each strategy's variants too, ``span{grain=2}``: what
    ``plan bench`` compiles) or comma-separated entries: ``name``, ``name{options}`` or either with
    ``:variant`` (tools/compare.py COMM_VARIANTS), each optionally with `` overlap{local=...}``; two
    entries that are one plan (``span``, ``span:p2p`` and, without ``keep_kv``, ``span
    overlap{local=first}``) are refused."""
    from .passes import strategies, strategy_entries
    if text == "all":
        return list(strategy_entries() if variants else strategies())
    from .passes.base import _split_top
    from .passes import parse_pipeline
    from .passes.comm import parse_entry
    from .passes.default import default_pipeline
    names = [s.strip() for s in _split_top(text)]  # commas inside {options} stay
    if not any(names):
        raise PlanError(f"no strategy in {text!r}; known: {', '.join(strategies())}")
    if not all(names):
        raise PlanError(f"an empty entry in --strategies {text!r}")
    seen: dict[str, str] = {}
    for n in names:  # one plan once: span and span:p2p, zigzag and zigzag{} are the same pipeline
        e = parse_entry(n)
        local = e.local if e.local != "kept" else "last" if keep_kv else "first"  # what kept resolves to
        passes = parse_pipeline(default_pipeline(e.strategy, 2048, e.comm, local))
        if any(getattr(p, "mode", None) == "a2a" for p in passes):  # all-to-alls: no order to choose
            passes = parse_pipeline(default_pipeline(e.strategy, 2048, e.comm, "first"))
        key = ",".join(p.spec() for p in passes)
        if key in seen:
            kept = " (overlap{local=kept}, the default, is last with --keep-kv, else first)" \
                if "overlap" in seen[key] + n else ""
            raise PlanError(f"--strategies lists {n!r} twice" if seen[key] == n else
                            f"--strategies lists one plan twice: {seen[key]!r} and {n!r} are the same plan{kept}")
        seen[key] = n
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="plan", description="attnplan: compile, inspect and run distributed attention plans. "
                 "Sizes are bounded by attnplan/ir/limits.py; -o - writes to standard output.",
                 epilog="exit codes: 0 ok; 1 a check failed (plan run --check, hf_train --check); 2 bad input "
                        "(one line on stderr: mask text, batch or plan files, flags)")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _add_compile(sub)
    _add_inspect(sub)
    _add_run(sub)
    _add_compare_bench(sub)
    from .cli_step import add_step_parser
    add_step_parser(sub)  # plan step ...
    return ap


def _add_compile(sub) -> None:
    c = sub.add_parser("compile", help="compile a batch and a mask into a plan file")
    _batch_args(c)
    c.add_argument("--mask", default="causal", help="builtin name, mask expression, or FILE.mask (default: causal)")
    c.add_argument("--devices", type=POSITIVE_DEVICES, required=True, help=f"devices, 1..{limits.MAX_DEVICES}")
    _shape_args(c, profile_help="cost profile for predicted times (h100, the default; h200, a100, cpu-local, or "
                                "FILE.json)")
    c.add_argument("--memory-cap", type=_int_in(1, limits.MAX_MEMORY_CAP), default=None,
                   help="bytes of buffers per device and phase the verifier holds the plan to (default: no cap)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--strategy", default="zigzag", help="a strategy, auto, NAME{options} (e.g. 'span{grain=2}'), "
                   f"or either as NAME:VARIANT (the strategy under another comm step: {_VARIANTS}), each "
                   "optionally followed by ' overlap{local=first|last|kept}' (the backward's order); default "
                   "zigzag, the deployed baseline — auto compiles the one predicted fastest")
    g.add_argument("--pipeline", help="pass pipeline, e.g. 'tile{block=1024},zigzag,comm,emit'")
    c.add_argument("--no-verify", action="store_true", help="skip the verifier between passes")
    c.add_argument("-v", "--verbose", action="store_true", help="print each pass and its time")
    c.add_argument("-o", "--output", required=True,
                   help="plan file to write; - writes its bytes to stdout (not to a terminal), the summary to stderr")


def _add_inspect(sub) -> None:
    """stats, show, mask, viz, explain: reading a plan (or a mask)."""
    s = sub.add_parser("stats", help="statistics of a plan")
    s.add_argument("plan", help="plan file (from plan compile)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--profile", default=None, help="cost profile for predicted times (default: the plan's)")

    sh = sub.add_parser("show", help="text form of a plan's programs")
    sh.add_argument("plan", help="plan file (from plan compile)")
    sh.add_argument("--device", type=int, default=None, help="only this device's programs (default: every device)")
    sh.add_argument("--level", default="program", choices=["program", "all"],
                    help="program: the instruction streams (default); all: every IR level, problem to program")

    m = sub.add_parser("mask", help="ASCII picture of a mask over a small batch")
    m.add_argument("mask")
    _batch_args(m)
    m.add_argument("--width", type=_int_in(1, limits.MAX_MASK_WIDTH), default=64,
                   help=f"columns, 1..{limits.MAX_MASK_WIDTH} (at most one a token)")
    m.add_argument("--head", type=_int_in(0, limits.MAX_HEADS - 1), default=None,
                   help="the query head h of a per-head mask (required when the mask uses h)")

    vz = sub.add_parser("viz", help="visual report of a plan: one self-contained HTML file and/or PNG pictures")
    vz.add_argument("plan", help="plan file (from plan compile)")
    vz.add_argument("-o", "--output", default=None, help="HTML report to write, e.g. report.html; - writes to stdout")
    vz.add_argument("--png", default=None, metavar="DIR", help="write mask/bars/comm/timeline PNGs into DIR")
    vz.add_argument("--profile", default=None, help="cost profile for the timeline (default: the plan's)")

    ex = sub.add_parser("explain", help="short text account: most loaded device and why, transfers, waits, cost")
    ex.add_argument("plan", help="plan file (from plan compile)")
    ex.add_argument("--device", type=int, default=None, help="explain this device (default: the most loaded)")
    ex.add_argument("--profile", default=None, help="cost profile (default: the plan's)")


def _add_run(sub) -> None:
    r = sub.add_parser("run", help="execute a plan: every device in this process (on the CPU or one GPU), or one "
                                   "process per device (--procs, CPU)")
    r.add_argument("plan", help="plan file (from plan compile)")
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the random inputs and of the run (default float32, whatever dtype the plan was "
                        "compiled for: the closest check against dense attention)")
    r.add_argument("--check", action="store_true", help="compare outputs and gradients with dense masked attention")
    r.add_argument("--devices", type=POSITIVE_DEVICES, default=None,
                   help="expected device count (error if the plan differs)")
    r.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0, help="seed of the random inputs, 0..2^64-1")
    r.add_argument("--procs", type=POSITIVE_DEVICES, default=None,
                   help="run on N local processes (gloo), one per device; under torchrun (RANK and WORLD_SIZE set) "
                        "this process runs as that rank")
    r.add_argument("--timeout", type=float, default=300.0,
                   help=f"seconds a transfer may take before the run fails naming the peer (multi-process runs; "
                        f"finite, at most {limits.MAX_TIMEOUT_S})")
    r.add_argument("--json", action="store_true", help="with --check: print the errors and tolerances as JSON")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where this process runs every device's program: the CPU, or one CUDA GPU (transfers "
                        "become device copies)")
    r.add_argument("--match", default=None, choices=["tag", "order"],
                   help="how messages are matched (multi-process runs): by tag (default, or $ATTNPLAN_MATCH), or "
                        "by posting order alone with one tag, as NCCL matches them")


def _add_compare_bench(sub) -> None:
    """compare, bench, calibrate: many strategies, many batches, this machine."""
    cp = sub.add_parser("compare", help="compile several strategies on one batch, side by side")
    _batch_args(cp)
    cp.add_argument("--mask", default="causal")
    cp.add_argument("--devices", type=POSITIVE_DEVICES, required=True, help=f"devices, 1..{limits.MAX_DEVICES}")
    _shape_args(cp)
    cp.add_argument("--strategies", default="all",
                    help="comma-separated strategy names, or all; NAME:VARIANT runs NAME's placement with another "
                         f"communication mode: {_VARIANTS}; ' overlap{{local=first|last|kept}}' after an entry sets "
                         "the backward's order")
    cp.add_argument("--json", action="store_true")
    cp.add_argument("--html", default=None, help="write the visual comparison report to this file")

    bn = sub.add_parser("bench", help="every strategy over a workload file: table, JSON, plots")
    bn.add_argument("--batches", default=None, help="JSONL of batches (default: shared/workloads/batches.jsonl beside "
                    "the attnplan package folder)")
    bn.add_argument("--names", default=None, help="comma-separated batch names to keep")
    bn.add_argument("--masks", type=_mask_list, default="causal",
                    help="masks separated by ';', e.g. 'causal;streaming(64,4096)'")
    bn.add_argument("--devices", type=_device_counts, default="8,32",
                    help=f"comma-separated device counts, each 1..{limits.MAX_DEVICES} (8 devices a node)")
    bn.add_argument("--strategies", default="all",
                    help="all (every strategy and its variants: span{grain=1}, span{grain=2}, ...) or comma-separated "
                    f"NAME, NAME{{options}}, NAME:VARIANT (VARIANT: {_VARIANTS}), each optionally with "
                    "' overlap{local=first|last|kept}'")
    _shape_args(bn, nodes=False)
    bn.add_argument("--out", default="out/bench", help="folder for bench.json, summary.txt and PNG plots "
                    "(created if missing; a path that is a file is an error; an earlier run's files are replaced)")
    bn.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    bn.add_argument("--json", action="store_true", help="print the rows, summary and best plans as JSON")

    cal = sub.add_parser("calibrate", help="measure this machine's kernel and gloo rates (or one GPU's kernels: "
                                           "--device cuda) into a cost profile")
    cal.add_argument("-o", "--output", default=None,
                     help="profile JSON to write (its folder must exist; default cpu-calibrated.json, "
                          "cuda-calibrated.json with --device cuda); - writes it to stdout")
    cal.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                     help="cuda: time the runtime's GPU kernels and merges on this GPU; the links come from --base")
    cal.add_argument("--base", default="h200", help="builtin profile whose links a --device cuda profile keeps")
    cal.add_argument("--repeats", type=_int_in(1, limits.MAX_REPEATS), default=5,
                     help=f"repeats of each measurement, 1..{limits.MAX_REPEATS}")


def _cmd_compile(args) -> int:
    from .api import compile as compile_plan
    check_output(args.output, "plan file", binary=True)
    batch = _load_batch(args).compile_args()

    def show(p, ir, dt):
        print(f"  {p.spec():<40} {dt * 1e3:9.1f} ms", file=sys.stderr)

    plan = compile_plan(**batch, mask=args.mask, devices=args.devices, nodes=args.nodes,
                        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, strategy=args.strategy,
                        block_size=args.block_size, pipeline=args.pipeline, dtype=args.dtype,
                        partials_dtype=args.partials_dtype, keep_kv=args.keep_kv,
                        memory_cap=args.memory_cap, verify=not args.no_verify, profile=args.profile,
                        instruments=(show,) if args.verbose else ())
    where = write_output(args.output, plan.to_bytes(), "plan file")
    s = plan.stats()
    print(f"wrote {where}: {s['devices']} devices, {s['tokens']} tokens, compute imbalance "
          f"{s['compute_imbalance']:.3f}, comm {s['comm_bytes_total'] / 1e6:.2f} MB, predicted "
          f"{s['predicted_s'] * 1e3:.3f} ms, planned in {s['plan_s']:.3f} s"
          + (f" ({plan.meta['strategy']})" if str(plan.meta.get("strategy", "")).startswith("auto:") else ""),
          file=summary_stream(args.output))
    return 0


def _cmd_stats(args) -> int:
    from .api import load
    from .backends.stats import format_stats
    s = load(args.plan).stats(args.profile)
    print(json.dumps(s, indent=2) if args.json else format_stats(s))
    return 0


def run_bytes(problem, dtype: str, check: bool) -> int:
    """Bytes of the global tensors one ``plan run`` process allocates: q, k, v,
    the output gradient, out, dq, dk, dv in ``dtype`` and, with ``--check``,
    the float64 reference out, dq, dk, dv (a lower bound of its memory).
    Python ints: no overflow, whatever the plan declares."""
    per_token = int(problem.head_dim) * (int(problem.heads) + int(problem.kv_heads))  # one q row + one k row
    elems = int(problem.tokens) * per_token
    from .ir.problem import DTYPE_BYTES
    item = DTYPE_BYTES[dtype]
    return 4 * elems * item + (2 * elems * 8 if check else 0)


def _check_run_size(plan, dtype: str, check: bool, procs: int) -> None:
    """Refuse, before allocating anything, a run over MAX_RUN_BYTES (every
    process of ``--procs`` builds the global inputs)."""
    need = procs * run_bytes(plan.problem, dtype, check)
    if need > limits.MAX_RUN_BYTES:
        each = f" in each of {procs} processes" if procs > 1 else ""
        raise PlanError(f"plan run would allocate about {need / 2 ** 30:,.1f} GiB of tensors (q, k, v and their "
                        f"gradients, {dtype}{', the float64 reference' if check else ''}{each}; "
                        f"{plan.problem.tokens:,} tokens), over the limit of {limits.MAX_RUN_BYTES / 2 ** 30:g} GiB "
                        f"(MAX_RUN_BYTES in ir/limits.py)")


def _cmd_run(args) -> int:
    import os

    from .api import load
    from .tools import launch
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= limits.MAX_TIMEOUT_S):
        raise PlanError(f"--timeout must be positive finite seconds, at most {limits.MAX_TIMEOUT_S:,}, "
                        f"got {args.timeout}")
    if launch.in_rank_mode():  # torchrun, or a process started by --procs
        if args.procs is not None and str(args.procs) != os.environ["WORLD_SIZE"]:
            raise PlanError(f"--procs {args.procs} differs from WORLD_SIZE={os.environ['WORLD_SIZE']}")
        if args.devices is not None and str(args.devices) != os.environ["WORLD_SIZE"]:
            raise PlanError(f"--devices {args.devices} differs from WORLD_SIZE={os.environ['WORLD_SIZE']}")
        _check_run_size(load(args.plan), args.dtype, args.check, 1)
        return launch.run_rank(args.plan, args.dtype, args.seed, args.check, args.timeout, match=args.match)
    plan = load(args.plan)
    if args.devices is not None and args.devices != plan.devices:
        raise PlanError(f"{args.plan} was compiled for {plan.devices} devices, not {args.devices}")
    if args.device == "cuda":
        import torch
        if args.procs is not None:
            raise PlanError("--procs runs gloo processes on the CPU; with --device cuda every device of the plan "
                            "runs in this process on one GPU (for one process per GPU, call attnplan.attention "
                            "under torchrun with an NCCL group)")
        if not torch.cuda.is_available():
            raise PlanError("--device cuda: torch sees no CUDA device here")
    if args.procs is not None:
        if args.procs != plan.devices:
            raise PlanError(f"{args.plan} was compiled for {plan.devices} devices; --procs must be {plan.devices}, "
                            f"got {args.procs}")
        _check_run_size(plan, args.dtype, args.check, args.procs)
        if args.check:  # what every rank would refuse, refused before starting them
            from .runtime.check import check_size
            check_size(plan)
        return launch.launch([str(args.plan), "--dtype", args.dtype, "--seed", str(args.seed), "--timeout",
                              repr(args.timeout)] + (["--check"] if args.check else [])
                             + (["--match", args.match] if args.match else []), args.procs)
    _check_run_size(plan, args.dtype, args.check, 1)
    from .runtime.check import check_plan, run_plan  # imports torch (~2 s): after every check
    t0 = time.perf_counter()
    if not args.check:
        run_plan(plan, args.dtype, args.seed, args.device)
        print(f"ran {plan.devices} devices forward+backward on {args.device} in {time.perf_counter() - t0:.2f} s")
        return 0
    r = check_plan(plan, args.dtype, args.seed, args.device)
    if args.json:
        print(json.dumps({"ok": r["ok"], "devices": plan.devices, "tokens": int(plan.problem.tokens),
                          "dtype": args.dtype, "device": args.device, "seconds": time.perf_counter() - t0,
                          "max_abs_error": {n: r[n] for n in ("out", "dq", "dk", "dv")}, "tolerance": r["tol"]},
                         indent=1))
        return 0 if r["ok"] else 1
    for name in ("out", "dq", "dk", "dv"):
        print(f"{name:>4}: max abs error {r[name]:.3e} (tolerance {r['tol'][name]:.1e})")
    print(f"{'PASS' if r['ok'] else 'FAIL'}: {plan.devices} devices, {plan.problem.tokens} tokens, {args.dtype}, "
          f"{args.device}, {time.perf_counter() - t0:.2f} s with the dense reference")
    return 0 if r["ok"] else 1


def _cmd_show(args) -> int:
    from .api import load
    plan = load(args.plan)
    if args.level == "all":
        if args.device is not None:
            plan.to_text(args.device)  # validates the device
        ir = plan.ir
        print(ir.problem.to_text())
        print(ir.need_graph().to_text())
        print(ir.need_placement().to_text())
        print(ir.need_schedule().to_text())
    sys.stdout.write(plan.to_text(args.device))
    return 0


def _cmd_mask(args) -> int:
    from .frontend import load_mask, render
    batch = _load_batch(args)
    tokens = batch.num_tokens + sum(batch.seqlens_k or ())  # queries and keys of cross-attention samples
    if tokens > 4096:
        raise PlanError(f"plan mask draws small batches (at most 4096 tokens); this one has {tokens:,}")
    print(render(load_mask(args.mask), batch, width=args.width, head=args.head))
    return 0


def _cmd_viz(args) -> int:
    from .api import load
    from .backends.viz import render_html, write_pngs
    if args.output is None and args.png is None:
        raise PlanError("plan viz needs -o REPORT.html and/or --png DIR")
    if args.output is not None:
        check_output(args.output, "report")
    plan = load(args.plan)
    if args.output is not None:
        text = render_html(plan, args.profile)
        where = write_output(args.output, text, "report")
        print(f"wrote {where} ({len(text.encode()) / 1e6:.2f} MB)", file=summary_stream(args.output))
    if args.png is not None:
        print("wrote " + ", ".join(str(p) for p in write_pngs(plan, args.png, args.profile)),
              file=summary_stream(args.output))
    return 0


def _cmd_explain(args) -> int:
    from .api import load
    from .backends.explain import explain
    print(explain(load(args.plan), device=args.device, profile=args.profile))
    return 0


def _cmd_compare(args) -> int:
    from .api import check_options
    from .tools.compare import compare, format_rows
    if args.html == STDOUT:
        raise PlanError("--html -: the table goes to stdout; give the report a file name")
    if args.html is not None:
        check_output(args.html, "report")
    batch = _load_batch(args).compile_args()
    strategies = _strategy_list(args.strategies, keep_kv=args.keep_kv)
    check_options(devices=args.devices, nodes=args.nodes, heads=args.heads, kv_heads=args.kv_heads,
                  head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype, profile=args.profile,
                  partials_dtype=args.partials_dtype, keep_kv=args.keep_kv)
    with progress(len(strategies), "planning") as advance:
        rows, plans = compare(strategies, progress=advance, **batch, mask=args.mask,
                              devices=args.devices, nodes=args.nodes, heads=args.heads, kv_heads=args.kv_heads,
                              head_dim=args.head_dim, block_size=args.block_size, dtype=args.dtype,
                              profile=args.profile, partials_dtype=args.partials_dtype, keep_kv=args.keep_kv)
    if args.html:
        from .backends.viz import render_compare_html
        write_output(args.html, render_compare_html(list(plans.items())), "report")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_rows(rows))
        if args.html:
            print(f"wrote {args.html}")
    return 0


def _bench_batches(args) -> str:
    """The workload file, and every ``--names`` entry present in it (BatchError otherwise)."""
    import os

    from .frontend import load_batch
    path = args.batches or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "workloads",
                                        "batches.jsonl")
    if not os.path.isfile(path):
        raise PlanError(f"batch file not found: {path} (give --batches FILE)")
    for name in _names(args.names) or ():
        load_batch(f"{path}:{name}")  # "no batch named ..., known: ..."
    return path


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PlanError(f"--names must list batch names separated by ',', got {text[:40]!r}")
    return names


def _cmd_bench(args) -> int:
    from .api import check_options
    from .frontend import load_mask
    from .tools.bench import bench
    path = _bench_batches(args)
    strategies = _strategy_list(args.strategies, variants=True, keep_kv=args.keep_kv)
    for mask in args.masks:  # a typo fails now, not after minutes of benchmarking
        load_mask(mask)
    check_options(devices=1, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  block_size=args.block_size, dtype=args.dtype, profile=args.profile,
                  partials_dtype=args.partials_dtype, keep_kv=args.keep_kv)
    from .tools.bench import ensure_out_dir
    out = ensure_out_dir(args.out)
    res = bench(path, args.masks, args.devices, strategies, out, names=_names(args.names), heads=args.heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size, profile=args.profile,
                dtype=args.dtype, partials_dtype=args.partials_dtype, keep_kv=args.keep_kv,
                show_progress=shows_progress(args.no_progress))
    if args.json:
        print(json.dumps({k: res[k] for k in ("rows", "summary", "best")}, indent=1, default=float))
        return 0
    print(res["text"])
    print("wrote " + ", ".join(str(f) for f in res["files"]))
    return 0


def _cmd_calibrate(args) -> int:
    from .runtime.calibrate import calibrate
    args.output = args.output or f"{args.device}-calibrated.json"
    check_output(args.output, "cost profile")
    if args.device == "cuda":
        from .runtime.calibrate_cuda import calibrate_cuda
        prof = calibrate_cuda(args.repeats, args.base)
        where = write_output(args.output, json.dumps(prof, indent=1) + "\n", "cost profile")
        print(f"wrote {where}: kernel {prof['peak_flops'] * prof['efficiency'] / 1e12:.1f} TFLOP/s (bf16, "
              f"{prof['efficiency']:.0%} of {prof['peak_flops'] / 1e12:.0f}), launch {prof['launch_s'] * 1e6:.1f} us, "
              f"merges {prof['mem_bw'] / 1e9:.0f} GB/s; links from {args.base}", file=summary_stream(args.output))
        return 0
    prof = calibrate(args.repeats)
    where = write_output(args.output, json.dumps(prof, indent=1) + "\n", "cost profile")
    print(f"wrote {where}: kernel {prof['peak_flops'] / 1e9:.1f} GFLOP/s (bf16, 1 thread), launch "
          f"{prof['launch_s'] * 1e6:.1f} us, gloo {prof['intra_bw'] / 1e9:.2f} GB/s, latency "
          f"{prof['intra_alpha'] * 1e6:.0f} us", file=summary_stream(args.output))
    return 0


def _cmd_step(args) -> int:
    from .cli_step import cmd_step
    return cmd_step(args)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cmds = {"compile": _cmd_compile, "stats": _cmd_stats, "run": _cmd_run, "show": _cmd_show, "mask": _cmd_mask,
            "compare": _cmd_compare, "bench": _cmd_bench, "calibrate": _cmd_calibrate, "viz": _cmd_viz,
            "explain": _cmd_explain, "step": _cmd_step}
    try:
        return cmds[args.cmd](args)
    except AttnplanError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `plan show x.plan | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
