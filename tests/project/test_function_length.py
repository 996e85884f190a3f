"""No function of the library is longer than 60 lines of code (blank lines, comments and docstrings aside):
a longer one is split into helpers with one job each. Read from the source with ``ast`` and ``tokenize``."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import dpvr

ROOT = Path(dpvr.__file__).resolve().parent
LIMIT = 60


def code_lines(source: str) -> set[int]:
    """The lines that hold a token of code: not blank, not only a comment, not only a string (docstrings)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.STRING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def function_lengths(source: str) -> dict[str, int]:
    """Each function's (and method's) number of code lines, by ``name:line``."""
    lines = code_lines(source)
    return {
        f"{node.name}:{node.lineno}": sum(1 for n in range(node.lineno, node.end_lineno + 1) if n in lines)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_the_count_reads_code_lines_only():
    source = '''def f(x):
    """A docstring
    of two lines."""
    # a comment

    y = (x +
         1)
    return "a string on a code line"
'''
    assert function_lengths(source) == {"f:1": 4}


def test_no_function_is_longer_than_the_limit():
    long = {
        f"{path.relative_to(ROOT.parent)} {name}": n
        for path in sorted(ROOT.rglob("*.py"))
        for name, n in function_lengths(path.read_text(encoding="utf-8")).items()
        if n > LIMIT
    }
    assert not long, f"functions over {LIMIT} code lines (split them into helpers): {long}"
