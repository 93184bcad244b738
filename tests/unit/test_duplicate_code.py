"""No block of six code lines or more repeats between product modules (tests and benchmarks aside), in the way
pylint's ``duplicate-code`` check counts: comments, docstrings, imports and blank lines do not count, lines
are compared token by token (so spacing does not matter), and lines of punctuation alone (a closing bracket)
are skipped. A repeated block is a missing function: give it one home and a name.
"""
from __future__ import annotations

import ast
import collections
import io
import tokenize

from tests.unit.test_layering import product_sources

MIN_LINES = 6
_LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def code_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, its tokens joined by spaces)`` of the lines that count (see the module docstring)."""
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped.update(range(node.lineno, node.end_lineno + 1))
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            skipped.update(range(body[0].lineno, body[0].end_lineno + 1))
    tokens: dict[int, list[str]] = collections.defaultdict(list)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _LAYOUT and tok.start[0] not in skipped:
            tokens[tok.start[0]].append(tok.string)
    return [(n, " ".join(t)) for n, t in sorted(tokens.items()) if any(c.isalnum() for c in " ".join(t))]


def repeated_blocks(sources: dict[str, str], min_lines: int = MIN_LINES) -> list[str]:
    """One line per pair of modules sharing a block of ``min_lines`` counted lines: where it starts in each."""
    places: dict[tuple[str, ...], list[tuple[str, int]]] = collections.defaultdict(list)
    for module, source in sources.items():
        lines = code_lines(source)
        for i in range(len(lines) - min_lines + 1):
            places[tuple(text for _, text in lines[i:i + min_lines])].append((module, lines[i][0]))
    pairs: dict[tuple[str, str], tuple[int, int]] = {}
    for found in places.values():
        modules = sorted({m for m, _ in found})
        for a, b in zip(modules, modules[1:]):
            first = (min(n for m, n in found if m == a), min(n for m, n in found if m == b))
            pairs.setdefault((a, b), first)
    return [f"{a}:{la} and {b}:{lb}" for (a, b), (la, lb) in sorted(pairs.items())]


def test_no_block_of_six_lines_repeats_between_product_modules():
    sources = {m: src for m, (src, _) in product_sources().items()}
    assert repeated_blocks(sources) == []


def test_the_finder_counts_code_lines_only():
    body = "".join(f"    total = total * {i} + step({i})\n" for i in range(6))
    six = f'def f(step):\n    """Doc."""\n    total = 0\n{body}    return total\n'
    spaced = six.replace(" * ", "*").replace("def f", "def g")           # same tokens, other spacing
    five = "".join(f"x{i} = compute({i})\n" for i in range(5))
    commented = "\n".join(f"x{i} = compute({i})  # note {i}" for i in range(5)) + "\n"
    found = repeated_blocks({"a": six, "b": spaced, "c": five, "d": commented, "e": "import os\nimport sys\n"})
    assert found == ["a:3 and b:3"]        # five lines are no block; comments and imports never count
