"""``plan step ...``: the training step as the unit of planning (attnplan.step).

    plan step compare (--batch FILE[:NAME] | --seqlens ...) --model M --mesh dp=D,cp=C [--nodes K]
                      [--systems a,b|all] [--profile P] [--json] [--html F]
    plan step compile (--batch ... | --seqlens ...) --model M --mesh ... --system S -o F.step
    plan step show F.step [--json]
    plan step bench [--batches FILE] [--names a,b] [--systems ...] [--model M] [--profile P] [--out DIR]

``compare``: one row per system, side by side on the same global batch
(``--html``: the step report, every system's per-rank timeline,
:mod:`attnplan.step.report`); ``compile``: one system's step plan file (the
micro-batch plan and every micro-batch's attention plan,
:mod:`attnplan.step.stepfile`); ``show``: every fragment of a step file with
its micro-batch and global ranks; ``bench``: the step suite
(:mod:`attnplan.tools.step_bench`). Every input error is one line on stderr
and exit code 2 (``cli.main`` catches it)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import sys

from .cli_io import check_output, progress, shows_progress, summary_stream, write_output
from .errors import StepError
from .ir import limits


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", t) or not lo <= int(t) <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo:,}..{hi:,}, got {text[:40]!r}")
        return int(t)
    parse.__name__ = "int"
    return parse


def _gib(text: str) -> int:
    """An argparse type: GiB of memory per device (a positive number), as bytes."""
    t = text.strip()
    if not re.fullmatch(r"[0-9]{1,7}(\.[0-9]{1,6})?", t) or float(t) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, e.g. 80, got {text[:40]!r}")
    return int(float(t) * 2**30)


PROFILE_HELP = "cost profile: h100 (default), h200, a100, cpu-local, or FILE.json"


def _problem_args(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seqlens", help="comma-separated document lengths, e.g. 60000,3000,900")
    src.add_argument("--batch", help="batch file (JSON or JSONL) or FILE:NAME for one line of a JSONL file")
    p.add_argument("--model", default="llama3-8b", help="preset (llama3-8b, the default; llama3-70b, qwen2.5-0.5b, "
                   "qwen2.5-7b, gpt-7b, llama-13b) or FILE.json")
    p.add_argument("--mesh", required=True, help="dp=D,cp=C[,pp=P[,vp=V]]: pp pipeline stages, vp model chunks "
                   "per stage (interleaved 1F1B)")
    p.add_argument("--stage-layers", default=None, help="layers of every model chunk (pp x vp of them), e.g. "
                   "9,8,8,7 (default: as even as possible)")
    p.add_argument("--nodes", type=_int_in(1, limits.MAX_MESH_DEVICES), default=None,
                   help="nodes the mesh spans (default: 8 devices a node)")
    p.add_argument("--profile", default="h100", help=PROFILE_HELP)
    p.add_argument("--mask", default="causal", help="the documents' mask (default: causal)")
    p.add_argument("--block-size", type=_int_in(1, limits.MAX_BLOCK_SIZE), default=2048,
                   help="tokens per block of the attention plans' tile pass (default 2048)")
    p.add_argument("--recompute", default="full", choices=["full", "none"],
                   help="activation recompute (default full: each layer keeps its input, recomputes the rest)")
    p.add_argument("--memory", type=_gib, default=None, help="GiB per device (default: the profile's)")
    _attention_args(p)


def _attention_args(p) -> None:
    p.add_argument("--partials-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the attention plans' partial outputs travel in: float32 (default) or bfloat16")
    p.add_argument("--keep-kv", action="store_true",
                   help="the attention backward reuses the K/V each device received in the forward (no KV moves "
                        "in the backward; without recompute each layer holds it until its backward)")


def add_step_parser(sub) -> None:
    """``plan step`` and its subcommands, added to ``plan``'s subparsers."""
    st = sub.add_parser("step", help="plan whole training steps (micro-batches x groups) and compare the systems")
    ss = st.add_subparsers(dest="step_cmd", required=True, parser_class=type(st))
    cp = ss.add_parser("compare", help="every batch-level system on one global batch, side by side")
    _problem_args(cp)
    cp.add_argument("--systems", default="all", help="comma-separated systems (options in braces: wlb{micro=2}), "
                    "or all")
    cp.add_argument("--json", action="store_true")
    cp.add_argument("--html", default=None, help="write the step report (per-rank timeline of every system) here; "
                    "- writes it to stdout, the table to stderr")
    co = ss.add_parser("compile", help="one system's step plan file: micro-batches, groups, attention plans")
    _problem_args(co)
    co.add_argument("--system", default="fixed",
                    help="the batch-level system (default: fixed, plain packing), e.g. wlb or pool{micro=2}")
    co.add_argument("-o", "--output", required=True, help="step plan file to write (F.step)")
    sh = ss.add_parser("show", help="every fragment of a step plan file with its micro-batch and global ranks, and "
                       "with a pipeline every stage's schedule")
    sh.add_argument("step_file")
    sh.add_argument("--json", action="store_true")
    bn = ss.add_parser("bench", help="every system on every batch of a workload file (4 nodes x 8 devices): "
                       "progress bar, table, JSON, plots")
    bn.add_argument("--batches", default=None, help="JSONL of batches (default: shared/workloads/batches.jsonl beside "
                    "the attnplan package folder)")
    bn.add_argument("--names", default=None, help="comma-separated batch names to keep")
    bn.add_argument("--systems", default="all", help="comma-separated systems (options in braces), or all")
    bn.add_argument("--model", default="llama3-8b", help="preset (default llama3-8b) or FILE.json")
    bn.add_argument("--profile", default="h100", help=PROFILE_HELP)
    bn.add_argument("--block-size", type=_int_in(1, limits.MAX_BLOCK_SIZE), default=2048,
                    help="tokens per block of the attention plans' tile pass (default 2048)")
    bn.add_argument("--recompute", default="full", choices=["full", "none"],
                    help="activation recompute (default full)")
    _attention_args(bn)
    bn.add_argument("--pp", type=_int_in(1, 64), default=1, help="pipeline stages (each 4 nodes x 8 devices)")
    bn.add_argument("--vp", type=_int_in(1, 64), default=1, help="model chunks per stage (interleaved 1F1B)")
    bn.add_argument("--out", default="out/step_bench", help="folder for step_bench.json, summary.txt and PNG "
                    "plots (created if missing; a path that is a file is an error; an earlier run's files are "
                    "replaced)")
    bn.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    bn.add_argument("--json", action="store_true", help="print the rows and summary as JSON")


@contextlib.contextmanager
def _c_stdout_to_stderr():
    """While systems plan, C code's stdout goes to stderr: HiGHS (flexsp's MILP, through scipy) can
    printf a debug line, which would corrupt ``--json`` or ``-o -`` output. Python's and C's stdout
    buffers are flushed before fd 1 is restored."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real fd 1 (captured in tests): nothing to guard
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        try:
            sys.stdout.flush()
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


def _mesh(args):
    from .step import parse_mesh
    probe = parse_mesh(args.mesh)
    per_node = 8
    if args.nodes is not None:
        if probe.devices % args.nodes:
            raise StepError(f"--nodes {args.nodes}: the mesh's {probe.devices} devices do not split evenly over "
                            f"{args.nodes} nodes")
        per_node = probe.devices // args.nodes
    layers = ()
    if args.stage_layers is not None:
        if not re.fullmatch(r"\s*[0-9]{1,6}(\s*,\s*[0-9]{1,6}){0,4095}\s*", args.stage_layers):
            raise StepError(f"--stage-layers must list layer counts separated by ',', e.g. 9,8,8,7, got "
                            f"{args.stage_layers[:40]!r}")
        layers = tuple(int(x) for x in args.stage_layers.split(","))
    return parse_mesh(args.mesh, per_node, recompute=args.recompute, memory_cap=args.memory or 0,
                      stage_layers=layers)


def _problem(args):
    from .frontend import load_batch, parse_seqlens
    from .step import make_problem
    mesh = _mesh(args)
    if args.seqlens is not None:
        if ":" in args.seqlens:
            raise StepError("plan step takes self-attention batches; QUERIES:KEYS lengths are cross-attention")
        lens = parse_seqlens(args.seqlens)
    else:
        b = load_batch(args.batch)
        if b.seqlens_k is not None:
            raise StepError("plan step takes self-attention batches; this one is cross-attention (seqlens_q, "
                            "seqlens_k)")
        if b.segments is not None:
            raise StepError("plan step does not take segments yet: give a batch of plain documents")
        lens = b.seqlens
    return make_problem(lens, model=args.model, mesh=mesh, profile=args.profile, mask=args.mask,
                        block_size=args.block_size, partials_dtype=args.partials_dtype, keep_kv=args.keep_kv)


def _cmd_compare(args) -> int:
    from .step.compare import compare_systems, format_rows, system_list
    names = system_list(args.systems)
    problem = _problem(args)
    mesh = problem.mesh
    if args.html is not None:
        if args.json and args.html == "-":
            raise StepError("--json with --html -: both would go to stdout; give the report a file name")
        check_output(args.html, "step report")
    with _c_stdout_to_stderr():
        with progress(len(names), "planning") as advance:
            rows, done = compare_systems(problem, names, progress=advance)
    if args.html is not None:
        from .step.report import render_step_html
        write_output(args.html, render_step_html(problem, rows, done), "step report")
    out = sys.stderr if args.html == "-" else sys.stdout   # stdout carries the HTML
    if args.json:
        print(json.dumps({"model": problem.model.name, "mesh": mesh.spec(), "devices_per_node": mesh.devices_per_node,
                          "profile": problem.profile.name, "tokens": problem.tokens, "documents": problem.docs,
                          "partials_dtype": problem.partials_dtype, "keep_kv": problem.keep_kv,
                          "rows": rows}, indent=2), file=out)
    else:
        opts = problem.attention_options()
        print(f"{problem.tokens:,} tokens in {problem.docs} documents, {problem.model.name}, {mesh.spec()} on "
              f"{mesh.nodes} node(s) of {mesh.devices_per_node}, {problem.profile.name}, recompute {mesh.recompute}"
              + (f", attention: {opts}" if opts else ""), file=out)
        print(format_rows(rows, mesh), file=out)
        if args.html:
            print(f"wrote {args.html if args.html != '-' else '<stdout>'}", file=out)
    return 0


def _cmd_compile(args) -> int:
    from .step import compile_step, parse_system
    from .step.mesh import gib
    from .step.stepfile import pack
    check_output(args.output, "step plan file", binary=True)
    parse_system(args.system)
    problem = _problem(args)
    with _c_stdout_to_stderr():
        c = compile_step(problem, args.system)
    where = write_output(args.output, pack(c), "step plan file")
    r = c.report
    print(f"wrote {where}: {c.plan.system}, {r['micro_batches']} micro-batches on {r['devices']} devices, step "
          f"{r['step_s'] * 1e3:.1f} ms ({r['step_over_lower_bound']:.3f} x lower bound), DP imbalance "
          f"{r['dp_imbalance']:.3f}, peak {r['peak_memory_bytes'] / 2**30:.1f} of {gib(r['memory_cap_bytes'])} "
          f"GiB, planned in {r['plan_s']:.2f} s" + _kept_note(c.plan), file=summary_stream(args.output))
    return 0


def _kept_note(plan) -> str:
    """Where ``--keep-kv`` could not keep the forward's KV (step/kept.py), for the summary line."""
    note = plan.kept_note()
    return f"; {note.split(': ')[0]}" if note else ""


def _cmd_show(args) -> int:
    from .step.stepfile import read_file, to_json
    loaded = read_file(args.step_file)
    if args.json:
        print(json.dumps(to_json(loaded), indent=1))
    else:
        print(loaded.plan.to_text(limit=limits.MAX_SAMPLES))
        if loaded.plan.problem.mesh.pp > 1 or loaded.plan.chunk_keep >= 1:
            from .step.pipeline import build_schedule
            print(build_schedule(loaded.plan).to_text(limit=limits.MAX_MICRO_BATCHES,
                                                      stage_devices=loaded.plan.problem.mesh.stage_devices))
    return 0


def _cmd_bench(args) -> int:
    from .backends.cost import get_profile
    from .step import Mesh, load_model
    from .step.compare import system_list
    from .tools.bench import ensure_out_dir, load_batches
    from .tools.step_bench import step_bench
    path = args.batches or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "workloads",
                                        "batches.jsonl")
    if not os.path.isfile(path):
        raise StepError(f"batch file not found: {path} (give --batches FILE)")
    names = None
    if args.names is not None:
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        if not names:
            raise StepError(f"--names must list batch names separated by ',', got {args.names[:40]!r}")
    system_list(args.systems)            # every input is checked before minutes of planning
    model = load_model(args.model)
    get_profile(args.profile)
    Mesh(4, 8, args.pp, vp=args.vp).chunk_layers(model.layers)  # the pipeline fits the model
    load_batches(path, names)            # "no batch named ..."
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise StepError(f"{args.out}: not a folder (--out names a folder for step_bench.json, summary.txt and plots)")
    ensure_out_dir(args.out)
    with _c_stdout_to_stderr():        # the progress bar goes to stderr too
        res = step_bench(path, args.systems, args.out, names=names, model=args.model, profile=args.profile,
                         recompute=args.recompute, block_size=args.block_size,
                         show_progress=shows_progress(args.no_progress), pp=args.pp, vp=args.vp,
                         partials_dtype=args.partials_dtype, keep_kv=args.keep_kv)
    if args.json:
        print(json.dumps({k: res[k] for k in ("rows", "summary")}, indent=1, default=float))
        return 0
    print(res["text"])
    print("wrote " + ", ".join(str(f) for f in res["files"]))
    return 0


def cmd_step(args) -> int:
    cmds = {"compare": _cmd_compare, "compile": _cmd_compile, "show": _cmd_show, "bench": _cmd_bench}
    return cmds[args.step_cmd](args)

