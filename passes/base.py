"""Passes: small frozen dataclasses with a ``name``, options as fields, one
``apply``. Registered by name; a pipeline is text such as
``tile{block=1024},zigzag,comm,emit``. Verification, timing and dumping hook
in around passes (``instruments``), never inside them."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..errors import AttnplanError, PlanError, VerifyError
from ..ir.limits import MAX_COMPUTE_BLOCKS
from ..ir.module import PlanIR
from ..ir.verify import VerifyCache, verify

REGISTRY: dict[str, type[Pass]] = {}
DEFAULT_RUN = 3e10  # overlap's FLOPs a kernel run holds before another partner starts a new one (comm.Overlap)


@dataclass(frozen=True, slots=True)
class Pass:
    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()  # IR levels that must exist before apply
    strategy: ClassVar[bool] = False       # a placement strategy (usable as --strategy NAME)
    default_comm: ClassVar[str] = "p2p"    # a strategy's communication mode in the default pipeline
    variants: ClassVar[tuple[str, ...]] = ()  # a strategy's other options that auto and plan bench also try
    default_run: ClassVar[float] = DEFAULT_RUN  # a strategy's overlap{run=...} in the default pipeline
    tree: ClassVar[bool] = False  # auto also tries it with comm{relay=tree} on several nodes (NAME:tree; tools/auto.py)

    def apply(self, ir: PlanIR) -> PlanIR:  # pragma: no cover - abstract
        raise NotImplementedError

    def spec(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}{{{opts}}}" if opts else self.name


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


def strategies() -> tuple[str, ...]:
    """Names of the registered placement strategies."""
    return tuple(sorted(n for n, c in REGISTRY.items() if c.strategy))


def strategy_entries() -> tuple[str, ...]:
    """Every registered strategy, and after each its ``variants`` as
    ``name{options}`` (``span{grain=1}``): the placements ``auto`` searches
    and ``plan bench --strategies all`` compiles."""
    return tuple(e for n in strategies() for e in (n, *(f"{n}{{{v}}}" for v in REGISTRY[n].variants)))


def strategy_name(entry: str) -> str:
    """The registered strategy of an entry ``name``, ``name{options}`` or
    either with ``:variant`` and `` overlap{local=...}`` (``span{grain=2}:direct`` -> ``span``)."""
    return (entry.partition(":")[0].partition("{")[0].split() or [""])[0]


def _convert(owner: str, field: dataclasses.Field, text: str, err: type[Exception] = PlanError):
    """The value of option ``field`` of ``owner`` (``"pass tile"``) from its
    text: ints in decimal (at most 19 digits), finite floats, booleans;
    anything else is ``err``."""
    typ = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    try:
        if typ.startswith("int"):
            digits = text.strip().lstrip("+-")
            if not digits.isascii() or not digits.isdigit() or len(digits.lstrip("0")) > 19:
                raise ValueError(text)
            return int(text)
        if typ.startswith("float"):
            value = float(text)
            if not math.isfinite(value):
                raise err(f"{owner}: option {field.name} must be a finite number, got {text!r}")
            return value
        if typ.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
    except ValueError:
        raise err(f"{owner}: option {field.name} must be {typ}, got {text!r}") from None
    return text


def _split_top(spec: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise PlanError(f"pipeline {spec!r}: unbalanced '}}'")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise PlanError(f"pipeline {spec!r}: unbalanced '{{'")
    return items + [cur]


def instantiate(cls, owner: str, options: str, err: type[Exception] = PlanError):
    """``cls(**options)`` from option text ``opt=value,...`` (the part between
    the braces of ``name{...}``), each value converted to its field's type;
    ``err`` naming ``owner`` (``"pass tile"``, ``"system wlb"``) on an unknown
    option, a bad value or a rejected combination. Pipelines and step
    systems are both written this way."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    opts = [o.strip() for o in options.split(",")] if options.strip() else []
    for opt in opts:
        key, eq, val = opt.partition("=")
        key = key.strip()
        if not opt:
            raise err(f"{owner}: an empty option in {options[:60]!r}; write opt=value,opt=value")
        if not eq and key in fields:
            raise err(f"{owner}: option {key!r} needs a value ({key}=...)")
        if not eq or key not in fields:
            raise err(f"{owner}: unknown option {opt[:60]!r}; options: {', '.join(fields) or '(none)'}")
        if key in kwargs:
            raise err(f"{owner}: option {key!r} given twice")
        kwargs[key] = _convert(owner, fields[key], val.strip(), err)
    try:
        return cls(**kwargs)
    except AttnplanError:
        raise
    except (TypeError, ValueError) as e:
        raise err(f"{owner}: {e}") from None


def parse_pipeline(spec: str) -> list[Pass]:
    """``name{opt=value,...},name,...`` → pass instances (clear errors on unknown names/options)."""
    passes = []
    for item in _split_top(spec.strip()):
        item = item.strip()
        if not item:
            raise PlanError(f"pipeline {spec!r}: empty pass name")
        name, brace, rest = item.partition("{")
        name = name.strip()
        if name not in REGISTRY:
            raise PlanError(f"unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}")
        if brace and not rest.endswith("}"):
            raise PlanError(f"pipeline item {item!r}: expected '}}' at the end")
        passes.append(instantiate(REGISTRY[name], f"pass {name}", rest[:-1], PlanError))
    return passes


Instrument = Callable[[Pass, PlanIR, float], None]


def run_pipeline(ir: PlanIR, passes: list[Pass], verify_each: bool = True,
                 instruments: tuple[Instrument, ...] = (), max_compute_blocks: int = MAX_COMPUTE_BLOCKS) -> PlanIR:
    """Apply ``passes`` in order; verify after each one (unless disabled) and
    call every instrument with (pass, result, seconds). A pass that makes more
    than ``max_compute_blocks`` compute blocks stops the pipeline with a
    PlanError instead of spending minutes lowering them (per-document zigzag
    of hundreds of short documents on 32 devices makes millions)."""
    done = VerifyCache()  # holds the verified levels themselves: a reused id cannot skip a check
    if verify_each:
        verify(ir, done)
    for p in passes:
        for level in p.needs:
            if getattr(ir, level) is None:
                raise PlanError(f"pass {p.name} needs a {level}; run a pass that makes one first")
        if type(p).strategy and ir.graph is not None and ir.graph.grouped:
            raise PlanError(f"pass {p.name} places the token blocks of the tile pass, but this graph's are varlen "
                            f"groups (a strategy made them): run tile again before {p.name}")
        t0 = time.perf_counter()
        ir = p.apply(ir)
        dt = time.perf_counter() - t0
        if ir.graph is not None and ir.graph.n_cb > max_compute_blocks:
            raise PlanError(f"pass {p.name} made {ir.graph.n_cb:,} compute blocks, over the limit of "
                            f"{max_compute_blocks:,}: use a larger block size, fewer devices or another strategy "
                            f"(or raise max_compute_blocks)")
        if verify_each:
            try:
                verify(ir, done)
            except VerifyError as e:
                raise VerifyError(f"after pass {p.spec()}: {e}") from None
        for inst in instruments:
            inst(p, ir, dt)
    return ir
