"""Docstrings and comments state contracts; measured figures live in bench/README.md, where they are measured again.

A figure in a docstring goes stale the day the code under it changes, and nothing re-measures it. This test scans the
docstrings (every string that stands as a statement: module, class, function and attribute docstrings) and the
comments of every ``preempt/**/*.py`` for what reads as a measurement, and fails naming ``file:line``:

* a throughput, or a time per size: ``1.2 GB/s``, ``150 MiB per second``, ``~1.5 s/GiB``, ``tens of ms per GiB``;
* a ratio: ``2.4x``, ``3 times faster``;
* a duration or a size in the same sentence as a word that says it was measured (measured, took, spent, on the VM, on
  this machine, on our machines), or set against another duration (``0.33 s populated against 0.42 s filled``).

Not figures: a size or a duration alone (``64 MiB`` a call, a grace of ``30 s``: contracts and defaults), version
numbers (``Linux 5.14``), constants, and an example of output inside an inline literal (a log line's ``... (150
MiB/s)``). Where a figure is worth keeping, it goes to bench/README.md's section "Figures once kept in docstrings", with
its module.
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "preempt"

_NUM = r"~?\d+(?:\.\d+)?"
_SIZE = r"(?:[KMGTP]i?B|[kKMGT]b(?:it)?s?|bytes?)"
_TIME = r"(?:ns|us|µs|ms|s|secs?|seconds?|min|minutes?|hours?)"
_QUANTITY = rf"{_NUM}\s?(?:{_TIME}|{_SIZE})\b"
_MEASURED = r"\b(?:measured|took|spent|on the VM|on (?:this|our|the \S+) machines?|\d+-core (?:VM|machine))\b"
_SENTENCE = r"(?:[^.;]|\.\d)"  # within one sentence: a decimal point does not end it
FIGURE = re.compile(
    "|".join(
        [
            rf"{_NUM}\s?{_SIZE}\s?(?:/|per|a)\s?(?:s|sec|second)\b",  # a throughput
            rf"\b{_TIME}\s?(?:/|per)\s?(?:{_NUM}\s?)?{_SIZE}\b",  # a time per size
            r"\b\d+(?:\.\d+)?[x×](?!\w)",  # a ratio
            rf"\b{_NUM}\s?times\s(?:faster|slower|longer|shorter|as\s(?:fast|slow|long))\b",
            rf"{_MEASURED}{_SENTENCE}{{0,80}}?{_QUANTITY}",  # measured, then the figure
            rf"{_QUANTITY}{_SENTENCE}{{0,80}}?{_MEASURED}",  # the figure, then where it was measured
            rf"{_NUM}\s?{_TIME}\b{_SENTENCE}{{0,40}}?\b(?:against|vs\.?|versus)\s{_NUM}\s?{_TIME}\b",  # set against
        ]
    ),
    re.IGNORECASE,
)
_LITERAL = re.compile(r"``.*?``")  # an inline literal: an example of output, not a claim


def _blocks(source: str) -> list[list[tuple[int, str]]]:
    """The docstrings and the runs of consecutive comment lines of ``source``, each a list of (line number, text)."""
    lines = source.splitlines()
    blocks = [
        [(n, lines[n - 1]) for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    comments: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        if comments and token.start[0] != comments[-1][0] + 1:
            blocks.append(comments)
            comments = []
        comments.append((token.start[0], token.string))
    if comments:
        blocks.append(comments)
    return blocks


def figures_in(source: str) -> list[tuple[int, str]]:
    """(line number, the line's text) where a measured figure starts in a docstring or a comment of ``source``; a
    sentence is read across the lines of its block."""
    found = []
    for block in _blocks(source):
        starts, text = [], ""
        for _, line in block:
            starts.append(len(text))
            text += _LITERAL.sub(lambda m: " " * len(m.group()), line.strip()) + " "
        for match in FIGURE.finditer(text):
            n, line = block[bisect.bisect_right(starts, match.start()) - 1]
            found.append((n, line.strip()))
    return sorted(set(found))


@pytest.mark.parametrize(
    "figure",
    [
        "writes at 1.2 GB/s on a local SSD",
        "a checkpoint of 1.5 GiB per second",
        "a page fault per 4 KiB, ~1.5 s/GiB here",
        "the pages let go (tens of ms per GiB at once)",
        "the copy is 2.4x the floor",
        "populating is 3 times faster",
        "Measured on the 2-core VM (1 GiB, 5 rounds): 0.33 s populated",
        "freeing torch: 0.4 to 2 s on our machines",
        "For the 1.5 GiB checkpoint (2-core VM), a write",
        "a model of a few hundred tensors spent ~10 ms here",
        "verify of that checkpoint took 1 GB.",
        "0.33 s populated against 0.42 s filled",
    ],
)
def test_a_figure_is_caught(figure):
    assert figures_in(f"X = 1  # {figure}\n") == [(1, f"# {figure}")]
    assert figures_in(f'def f():\n    """Does it.\n\n    {figure}\n    """\n') == [(4, figure)]


def test_a_sentence_is_read_across_the_lines_of_its_comment():
    assert figures_in("# the first save took\n# 0.3 s, the next\nX = 1\n") == [(1, "# the first save took")]


@pytest.mark.parametrize(
    "contract",
    [
        "One call per 64 MiB maps every page writable",
        "the VM is stopped about 30 s later (Google documents 30 s for spot VMs)",
        "Where the kernel has MADV_POPULATE_WRITE (Linux 5.14); measured on Slurm 22.05",
        "scontrol was killed (exit code -15) under load, as measured",
        "Records metrics measured at ``step`` (default ``run.global_step``)",
        "``a checkpoint of 1.2 GiB in 8.0 s (150 MiB/s), its upload 20 s``",
        "the staging arena of a 1.5 GiB state would lock 2 GiB",
        "caps of 1 << 20 bytes; a shape of (3 x 4); 0x1F",
        "several times slower (bench/README.md)",
    ],
)
def test_a_contract_passes(contract):
    assert figures_in(f'"""{contract}"""\n# {contract}\n') == []


def test_strings_that_are_not_docstrings_are_not_read():
    assert figures_in('RATE = f"{n / s:.2f} GB/s"\nlog("took 3 s", 2.4)\n') == []


def test_no_docstring_or_comment_of_the_package_quotes_a_measured_figure():
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{n}: {line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in figures_in(path.read_text(encoding="utf-8"))
    ]
    assert not found, "measured figures in docstrings or comments (move them to bench/README.md):\n" + "\n".join(found)
