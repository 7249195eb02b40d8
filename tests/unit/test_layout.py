"""The package's shape (issue 14): modules of one concern, no import circles among them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "preempt"
MAX_LINES = 600
# Modules over the limit, each to be split. Empty since PreemptibleRun became a face over its parts (issue 14).
TOO_LONG_FOR_NOW: set[str] = set()


def imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "preempt":
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("preempt."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("preempt."))
    return {m for m in out if (PACKAGE / f"{m}.py").exists()}


def test_no_import_circle():
    graph = {p.stem: imports(p) - {p.stem} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, [" -> ".join(c) for c in cycles]


# The run's parts (preempt/README.md): each imports only parts before it.
PARTS = [
    "run_config", "loop_state", "data_cursor", "snapshot", "peers", "save_scheduler", "stopping", "reporting",
    "health", "resume_plan", "restore", "run",
]  # fmt: skip


def test_the_runs_parts_import_only_the_parts_before_them():
    wrong = {}
    for i, part in enumerate(PARTS):
        later = imports(PACKAGE / f"{part}.py") & set(PARTS[i + 1 :])
        if later:
            wrong[part] = sorted(later)
    assert not wrong, wrong


def test_the_building_blocks_do_not_import_the_run():
    blocks = [p for p in PACKAGE.glob("*.py") if p.stem not in PARTS and p.stem != "__init__"]
    wrong = {p.stem: sorted(imports(p) & set(PARTS) - {"run_config"}) for p in blocks}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def test_modules_are_short():
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= TOO_LONG_FOR_NOW, {k: v for k, v in long.items() if k not in TOO_LONG_FOR_NOW}


def test_the_circle_check_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from . import peers, nothing_here\nfrom .policy import decide\nimport preempt.snapshot\n"
        "from preempt import restore\nfrom preempt.stopping import Stopper\n\ndef f():\n    from . import reporting\n"
    )
    assert imports(source) == {"peers", "policy", "snapshot", "restore", "stopping", "reporting"}
