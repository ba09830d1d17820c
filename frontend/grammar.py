"""Loading the mask grammar (``mask.lark``, LALR with positions) and turning
lark's syntax errors into :class:`MaskError` with a line, a column and words
a user understands ("expected an expression, got ')'")."""

from __future__ import annotations

from pathlib import Path

from lark import Lark, Token
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark.lark import PostLex

from attnplan.errors import MaskError
from attnplan.ir.limits import MAX_MASK_DEPTH

__all__ = ["parse_text", "parser", "syntax_error", "end_position"]


class TooDeep(Exception):
    """More than MAX_MASK_DEPTH parentheses open at once (carries the token that passed it)."""

    def __init__(self, tok: Token):
        super().__init__(tok)
        self.tok = tok


class _ParenNewlines(PostLex):
    """Drop newlines inside parentheses so an expression can span lines; stop at
    MAX_MASK_DEPTH open parentheses."""
    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for tok in stream:
            if tok.type == "LPAR":
                depth += 1
                if depth > MAX_MASK_DEPTH:
                    raise TooDeep(tok)
            elif tok.type == "RPAR":
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


_PARSERS: dict = {}


def parser(transformer=None) -> Lark:
    """The (cached) LALR parser of the mask language; with ``transformer``, one that builds its result
    while it reduces (lark's inline transformer) instead of a parse tree."""
    key = id(transformer)
    if key not in _PARSERS:
        _PARSERS[key] = (Lark(Path(__file__).with_name("mask.lark").read_text(), parser="lalr",
                              postlex=_ParenNewlines(), maybe_placeholders=False,  # tokens carry line/col
                              transformer=transformer), transformer)
    return _PARSERS[key][0]


_EXPR_START = {"NAME", "NUMBER", "LPAR", "MINUS", "NOT"}
_OPERATORS = {"PLUS", "MINUS", "STAR", "FLOORDIV", "PERCENT", "CMP", "AND", "OR", "IN"}
_PUNCT = {"LPAR": "'('", "RPAR": "')'", "COMMA": "','", "EQUAL": "'='", "LET": "'let'"}


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of input"
    if tok.type == "_NL":
        return "end of line"
    return repr(tok.value)


def _expected_words(accepts: set[str]) -> str:
    acc = set(accepts)
    words = []
    if {"NAME", "NUMBER"} <= acc:
        words.append("an expression")
        acc -= _EXPR_START
    if acc & _OPERATORS:
        words.append("an operator")
        acc -= _OPERATORS
        acc -= {"LPAR", "EQUAL"}  # `f(` and `mask =` after a bare name: not worth listing
    if acc == {"NAME"}:
        words.append("a name")
        acc = set()
    acc.discard("NAME")
    words += [_PUNCT[t] for t in ("LPAR", "COMMA", "RPAR", "EQUAL", "LET") if t in acc]
    if acc & {"_NL", "$END"}:
        words.append("end of line")
    if not words:
        return "something else"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def end_position(text: str) -> tuple[int, int]:
    """(line, col) just after the last non-blank character of ``text``."""
    body = text.rstrip()
    line = body.count("\n") + 1
    return line, len(body) - (body.rfind("\n") + 1) + 1


def _line_text(text: str, line: int) -> str:
    start = 0
    for _ in range(line - 1):
        start = text.index("\n", start) + 1
    end = text.find("\n", start)
    return text[start:] if end < 0 else text[start:end]


def _unexpected_token(e: UnexpectedToken, text: str, filename: str) -> MaskError:
    tok = e.token
    accepts = e.accepts or e.expected
    line, col = (tok.line, tok.column) if tok.type != "$END" else end_position(text)
    if tok.type == "_NL" and tok.line is not None:
        # point after the last character of the line that ended early
        line = tok.line
        col = len(_line_text(text, line).split("#")[0].rstrip()) + 1
    msg = f"expected {_expected_words(accepts)}, got {_describe_token(tok)}"
    if tok.type == "EQUAL":
        msg += " (to compare, use `==`)"
    return MaskError(msg, filename, line or 1, col or 1, text)


def parse_text(text: str, filename: str, transformer=None):
    """lark's parse of ``text`` (a parse tree, or what ``transformer`` builds); every failure is one
    MaskError with a line and column."""
    try:
        return parser(transformer).parse(text)
    except UnexpectedInput as e:
        raise syntax_error(e, text, filename) from None
    except TooDeep as e:
        raise MaskError(f"parentheses nested more than MAX_MASK_DEPTH = {MAX_MASK_DEPTH:,} deep (ir/limits.py)",
                        filename, e.tok.line or 1, e.tok.column or 1, text) from None
    except (LarkError, RecursionError) as e:  # never expected from LALR; still one clear error
        line, col = end_position(text)
        raise MaskError(f"cannot parse the mask ({type(e).__name__})", filename, line, col, text) from None


def syntax_error(e: UnexpectedInput, text: str, filename: str) -> MaskError:
    """The MaskError for one of lark's syntax errors."""
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream is not None and e.pos_in_stream < len(text) else e.char
        return MaskError(f"unexpected character {ch!r}", filename, e.line, e.column, text)
    if isinstance(e, UnexpectedToken):
        return _unexpected_token(e, text, filename)
    line, col = end_position(text)
    return MaskError("unexpected end of input", filename, line, col, text)
