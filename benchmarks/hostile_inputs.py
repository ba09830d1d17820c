"""Every bad or extreme input of issue 8, run as a user would (the `plan` CLI in
a fresh process), with its wall time, peak memory (max RSS) and outcome.

An input passes when it ends, within the time and memory bounds, either with
exit 0 (legitimate input, correct result) or exit 2 with one line of error on
stderr and no traceback (bad input).

    .venv/bin/python benchmarks/hostile_inputs.py [--timeout 120] [--json out/hostile.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PLAN = str(Path(sys.executable).with_name("plan"))
HEADER = struct.Struct("<8sHHQ32s")
MAX_RSS_MB = 4096


def run_measured(argv, timeout, env=None):
    """Like :func:`run` but with the child's peak RSS from wait4."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as ef:
        p = subprocess.Popen([PLAN] + argv, stdout=subprocess.DEVNULL, stderr=ef, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, **(env or {})), start_new_session=True)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(p.pid, 9)
                pid, status, ru = os.wait4(p.pid, 0)
                ef.seek(0)
                return None, time.perf_counter() - t0, ru.ru_maxrss / 1024, ef.read().decode(errors="replace")
            time.sleep(0.02)
        p.returncode = os.waitstatus_to_exitcode(status)
        ef.seek(0)
        return p.returncode, time.perf_counter() - t0, ru.ru_maxrss / 1024, ef.read().decode(errors="replace")


# crafted plan files ------------------------------------------------------------------------------------------------
def read_body(path):
    data = Path(path).read_bytes()
    return msgpack.unpackb(zlib.decompress(data[HEADER.size:]), raw=False)


def write_raw(path, raw: bytes):
    Path(path).write_bytes(HEADER.pack(b"ATTNPLAN", 1, 0, len(raw), hashlib.sha256(raw).digest()) + raw)


def write_body(path, body):
    write_raw(path, zlib.compress(msgpack.packb(body, use_bin_type=True), 6))


def arr(values, dtype="<i8"):
    a = np.asarray(values, dtype=dtype)
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def crafted(tmp: Path, base: Path) -> dict[str, Path]:
    out = {}
    body = read_body(base)
    # 1 MB of compressed zeros that inflate to 1 GiB
    z = zlib.compressobj(9)
    chunk = b"\0" * (1 << 24)
    raw = b"".join(z.compress(chunk) for _ in range(64)) + z.flush()
    write_raw(tmp / "bomb.plan", raw)
    out["plan file inflating to 1 GiB"] = tmp / "bomb.plan"
    b = dict(body, devices=100_000)
    write_body(tmp / "devices.plan", b)
    out["plan file declaring 100,000 devices"] = tmp / "devices.plan"
    big = tmp / "huge.plan"  # sparse 3 GB file whose header claims a 3 GB body
    with open(big, "wb") as f:
        f.write(HEADER.pack(b"ATTNPLAN", 1, 0, 3 << 30, b"\0" * 32))
        f.truncate(HEADER.size + (3 << 30))
    out["3 GB plan file (sparse)"] = big
    prog = body["program"]
    code = [[dict(c) for c in ph] for ph in prog["code"]]
    c0 = np.frombuffer(code[0][0]["data"], dtype=code[0][0]["dtype"]).reshape(code[0][0]["shape"]).astype(np.int64)
    c0 = c0.copy()
    c0[c0[:, 0] == 3, 0] = 5  # attn -> attn_bwd in the forward phase
    code[0][0] = arr(c0)
    write_body(tmp / "opcode.plan", dict(body, program=dict(prog, code=code)))
    out["forward attn rewritten as attn_bwd"] = tmp / "opcode.plan"
    pb = body["problem"]
    lens = np.frombuffer(pb["seqlens"]["data"], dtype=pb["seqlens"]["dtype"]).astype(np.int64)
    write_body(tmp / "zero.plan", dict(body, problem=dict(pb, seqlens=arr(list(lens) + [0]))))
    out["extra sample of length 0"] = tmp / "zero.plan"
    wrap = [1 << 62] * 4  # sums to 2^64: 0 in int64
    write_body(tmp / "wrap.plan", dict(body, problem=dict(pb, seqlens=arr(wrap))))
    out["sample lengths summing past 2^63"] = tmp / "wrap.plan"
    write_body(tmp / "2g.plan", dict(body, problem=dict(pb, seqlens=arr([1 << 31]))))
    out["2^31-token plan"] = tmp / "2g.plan"
    write_body(tmp / "profile.plan", dict(body, meta=dict(body.get("meta", {}), profile="/etc/passwd")))
    out["meta.profile naming /etc/passwd"] = tmp / "profile.plan"
    return out


def long_unions() -> dict[str, str]:
    """Mask files of one long union: 10,000 diagonals ``k - q == d`` (for 300 tokens), 10,000 rectangles of
    up to 256 x 256 (for 4,096 tokens; they overlap), and the rectangles with a typo in the last term."""
    rng = np.random.default_rng(0)
    diag = " | ".join(f"k - q == {d}" for d in rng.integers(-300, 300, 10_000))
    lo = rng.integers(0, 4096 - 256, (10_000, 2))
    hi = lo + rng.integers(1, 256, (10_000, 2))
    rect = " | ".join(f"(q >= {a} & q < {b} & k >= {c} & k < {d})" for (a, c), (b, d) in zip(lo, hi))
    return {"diag.mask": diag, "rect.mask": rect, "typo.mask": rect[:-1] + " & kk)"}


def cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(name, argv, expected: 'ok' | 'error')."""
    base = tmp / "base.plan"
    subprocess.run([PLAN, "compile", "--seqlens", "300,200", "--devices", "2", "--block-size", "64", "-o", str(base)],
                   check=True, stdout=subprocess.DEVNULL)
    let_exp = "\n".join(["let m0 = causal"] + [f"let m{i} = m{i - 1} & m{i - 1}" for i in range(1, 41)] + ["m40"])
    let_lin = "\n".join(["let m0 = causal"] + [f"let m{i} = m{i - 1} | k < 0" for i in range(1, 20000)] + ["m19999"])
    (tmp / "exp.mask").write_text(let_exp)
    (tmp / "lin.mask").write_text(let_lin)
    for name, text in long_unions().items():
        (tmp / name).write_text(text)
    (tmp / "ones.json").write_text(json.dumps({"seqlens": [1] * 100_000}))  # too long for one argv word
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    good = json.loads(subprocess.run([str(Path(sys.executable)), "-c", "import dataclasses, json; from attnplan.backends."
                                      "cost import PROFILES; print(json.dumps(dataclasses.asdict(PROFILES['h100'])))"],
                                     check=True, capture_output=True, text=True).stdout)
    prof = {"strings.json": dict(good, peak_flops="fast"), "zeros.json": dict(good, intra_bw=0),
            "negative.json": dict(good, launch_s=-2.0)}  # one bad value each in an otherwise complete profile
    for f, v in prof.items():
        (tmp / f).write_text(json.dumps(v))
    (tmp / "file").write_text("x")
    c = [
        ("--devices 100000 on 500 tokens", ["compile", "--seqlens", "500", "--devices", "100000", "-o", f"{tmp}/a.plan"], "error"),
        ("--devices 1000 on 500 tokens", ["compile", "--seqlens", "500", "--devices", "1000", "-o", f"{tmp}/a.plan"], "error"),
        ("--devices 256 (the limit) on 500 tokens", ["compile", "--seqlens", "500", "--devices", "256", "-o", f"{tmp}/d.plan"], "ok"),
        ("plan stats of that plan", ["stats", f"{tmp}/d.plan"], "ok"),
        ("--seqlens 100000 --block-size 1", ["compile", "--seqlens", "100000", "--block-size", "1", "--devices", "8", "-o", f"{tmp}/a.plan"], "error"),
        ("--seqlens 2^26 (MAX_TOKENS) on 2 devices", ["compile", "--seqlens", str(1 << 26), "--devices", "2", "-o", f"{tmp}/a.plan"], "error"),
        ("--seqlens 2000000 --block-size 64", ["compile", "--seqlens", "2000000", "--block-size", "64", "--devices", "8", "-o", f"{tmp}/a.plan"], "error"),
        ("--devices 3000 on 500 tokens", ["compile", "--seqlens", "500", "--devices", "3000", "-o", f"{tmp}/a.plan"], "error"),
        ("--devices 10**12", ["compile", "--seqlens", "500", "--devices", str(10**12), "-o", f"{tmp}/a.plan"], "error"),
        ("--seqlens 10**12", ["compile", "--seqlens", str(10**12), "--devices", "4", "-o", f"{tmp}/a.plan"], "error"),
        ("--seqlens 99999999999999999999999", ["compile", "--seqlens", "9" * 23, "--devices", "4", "-o", f"{tmp}/a.plan"], "error"),
        ("--block-size 10**25", ["compile", "--seqlens", "500", "--devices", "4", "--block-size", str(10**25), "-o", f"{tmp}/a.plan"], "error"),
        ("40 let lines, each using the previous twice", ["compile", "--seqlens", "500", "--devices", "2", "--mask", f"{tmp}/exp.mask", "-o", f"{tmp}/a.plan"], "ok"),
        ("20,000 let lines", ["compile", "--seqlens", "500", "--devices", "2", "--mask", f"{tmp}/lin.mask", "-o", f"{tmp}/a.plan"], "ok"),
        ("chunked_causal(1) on 60,000 tokens", ["compile", "--seqlens", "60000", "--devices", "4", "--mask", "chunked_causal(1)", "-o", f"{tmp}/cc.plan"], "ok"),
        ("plan stats of that plan", ["stats", f"{tmp}/cc.plan"], "ok"),
        ("100,000 one-token documents, zigzag, 4 devices", ["compile", "--batch", f"{tmp}/ones.json", "--devices", "4", "-o", f"{tmp}/a.plan"], "ok"),
        ("100,000-deep batch JSON", ["compile", "--batch", f"{tmp}/deep.json", "--devices", "2", "-o", f"{tmp}/a.plan"], "error"),
        ("mask literal of 5,000 digits", ["compile", "--seqlens", "500", "--devices", "2", "--mask", "k < " + "9" * 5000, "-o", f"{tmp}/a.plan"], "error"),
        ("union of 10,000 diagonals on 300 tokens", ["compile", "--seqlens", "300", "--devices", "2", "--mask", f"{tmp}/diag.mask", "-o", f"{tmp}/a.plan"], "ok"),
        ("union of 10,000 rectangles on 4,096 tokens", ["compile", "--seqlens", "4096", "--devices", "2", "--mask", f"{tmp}/rect.mask", "-o", f"{tmp}/a.plan"], "ok"),
        ("that union with a typo in its last term", ["compile", "--seqlens", "4096", "--devices", "2", "--mask", f"{tmp}/typo.mask", "-o", f"{tmp}/a.plan"], "error"),
        ("complement of 4,681 diagonals on 16,384 tokens", ["compile", "--seqlens", "16384", "--devices", "2", "--mask", "!((k - q) % 7 == 0)", "-o", f"{tmp}/a.plan"], "ok"),
        ("complement of 4,681 clipped diagonals on 16,384 tokens", ["compile", "--seqlens", "16384", "--devices", "2", "--mask", "!((k - q) % 7 == 0 & k >= 5)", "-o", f"{tmp}/a.plan"], "error"),
        ("union of 490 terms", ["compile", "--seqlens", "500", "--devices", "2", "--mask", " | ".join(["causal"] * 490), "-o", f"{tmp}/a.plan"], "ok"),
        ("empty mask: k < q on one-token documents", ["compile", "--seqlens", "1,1,1", "--devices", "2", "--mask", "k < q", "-o", f"{tmp}/e.plan"], "ok"),
        ("empty mask: !full", ["compile", "--seqlens", "100", "--devices", "2", "--mask", "!full", "-o", f"{tmp}/e2.plan"], "ok"),
        ("run --check of the empty-mask plan", ["run", f"{tmp}/e2.plan", "--check"], "ok"),
        ("run --seed 2**70", ["run", str(base), "--seed", str(2**70)], "error"),
        ("run --timeout inf", ["run", str(base), "--procs", "2", "--timeout", "inf"], "error"),
        ("bench --masks ''", ["bench", "--masks", "", "--out", f"{tmp}/bench"], "error"),
        ("bench --out FILE", ["bench", "--out", f"{tmp}/file"], "error"),
        ("bench --devices 0", ["bench", "--devices", "0", "--out", f"{tmp}/bench"], "error"),
        ("calibrate --repeats 0", ["calibrate", "--repeats", "0", "-o", f"{tmp}/c.json"], "error"),
        ("calibrate -o into a missing folder", ["calibrate", "-o", f"{tmp}/missing/c.json"], "error"),
        ("-o - (stdout or a clear refusal)", ["compile", "--seqlens", "500", "--devices", "2", "-o", "-"], "any"),
        ("pass option nan", ["compile", "--seqlens", "500", "--devices", "2", "--pipeline", "tile{block=64},hypergraph{eps=nan},comm,emit", "-o", f"{tmp}/a.plan"], "error"),
    ]
    for f in prof:
        c.append((f"cost profile {f}", ["stats", str(base), "--profile", f"{tmp}/{f}"], "error"))
    for name, path in crafted(tmp, base).items():
        c.append((name, ["run", str(path), "--check"] if "profile" not in name else ["stats", str(path)], "error"))
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this text")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows, bad = [], 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"{'input':<48} {'want':>5} {'rc':>4} {'s':>7} {'MB':>7}  verdict / message", flush=True)
        for name, argv_, want in cases(tmp):
            if args.only and args.only not in name:
                continue
            rc, s, mb, err = run_measured(argv_, args.timeout)
            lines = [ln for ln in err.strip().splitlines() if ln.strip()]
            tb = "Traceback" in err
            ok = rc is not None and not tb and mb <= MAX_RSS_MB and (
                rc == 0 if want == "ok" else rc in (0, 2) if want == "any" else (rc == 2 and len(lines) >= 1))
            bad += not ok
            msg = (lines[0] if lines else "")[:70]
            print(f"{name:<48} {want:>5} {str(rc):>4} {s:7.2f} {mb:7.0f}  {'PASS' if ok else 'FAIL'} {msg}", flush=True)
            rows.append({"input": name, "want": want, "rc": rc, "seconds": round(s, 3), "max_rss_mb": round(mb),
                         "pass": ok, "stderr": err[-2000:]})
    print(f"{len(rows) - bad} passed, {bad} failed")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
