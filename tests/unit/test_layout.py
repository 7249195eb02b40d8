"""The package's shape: subpackages by part, modules of one job each, no import circles.

Which part may import which is written down as import-linter contracts in pyproject.toml (``lint-imports``, run by
.ci/run); the tests here check what those contracts do not: circles between modules, that each module says its one
job and its part names it, that no formatting is switched off to pack a module, and what the top level holds.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "preempt"
# The top level: the face (__init__), `python -m preempt`, and the leaves every part may import.
TOP_LEVEL = {
    "__init__.py",
    "__main__.py",
    "errors.py",
    "_log.py",
    "_version.py",
    "_torch_compat.py",
    "_testing.py",
    "_secrets.py",
}
PARTS = {"checkpoint", "data", "cluster", "health", "mirror", "run", "cli", "supervise", "lightning", "hf", "ray"}
# The parts whose __init__ is the face a user imports (``from preempt.lightning import PreemptCallback``): a
# framework's integration, imported only by who uses that framework.
FACES = {"lightning", "hf", "ray"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path, known: set[str], root: Path = PACKAGE) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions (as import-linter counts them)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def test_no_import_circle():
    known = set(modules())
    # The subpackages' __init__ hold only a docstring; the face's lazy names (preempt/__init__) are not imports.
    graph = {m: imports(p, known) - {"preempt"} for m, p in modules().items() if p.name != "__init__.py"}
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


def test_each_module_says_its_one_job_and_its_part_names_it():
    """One job per module, as a map a reader can check: the module's docstring opens with it in one line, and the
    part's ``__init__`` docstring, which says what the part owns, names the module beside its job."""
    for path in sorted(modules().values()):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{path}: a docstring whose first line says what the module does"
        part = path.parent
        if part == PACKAGE or path.name == "__init__.py":
            continue
        owner = ast.get_docstring(ast.parse((part / "__init__.py").read_text())) or ""
        assert f"``{path.stem}``" in owner, f"{part / '__init__.py'}: does not name ``{path.stem}`` and what it owns"


def test_formatting_is_never_switched_off_to_pack_code():
    packed = [
        f"{p}:{i}"
        for p in PACKAGE.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: " + "skip" in line or "fmt: " + "off" in line
    ]
    assert not packed, packed


def test_the_top_level_holds_the_face_the_leaves_and_the_parts():
    files = {p.name for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files == TOP_LEVEL, f"a new module belongs in the part it serves, not at the top: {files - TOP_LEVEL}"
    assert folders == PARTS


def test_each_part_says_what_it_owns_and_what_it_may_import():
    for part in sorted(PARTS):
        init = PACKAGE / part / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and "May import" in doc, f"{init}: a docstring saying what the part owns and what it may import"
        if part in FACES:  # the docstring, its imports and __all__
            assert all(isinstance(n, (ast.Expr, ast.ImportFrom, ast.Assign)) for n in tree.body), init
            continue
        # Only the docstring: importing preempt.cluster.signals must not load the rest of cluster (torch).
        assert len(tree.body) == 1, f"{init}: holds only its docstring"


def test_the_circle_check_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "preempt" / "run"
    pkg.mkdir(parents=True)
    source = pkg / "m.py"
    source.write_text(
        "from . import peers, nothing_here\nfrom .due import decide\nimport preempt.cluster.signals\n"
        "from preempt.data import rng\nfrom ..checkpoint.state import MODEL_FILE\n\n"
        "def f():\n    from ..cli import main\n"
    )
    known = {
        "preempt.run.peers", "preempt.run.due", "preempt.cluster.signals", "preempt.data", "preempt.data.rng",
        "preempt.checkpoint.state", "preempt.cli", "preempt.cli.main",
        "preempt.run",
    }  # fmt: skip
    assert imports(source, known, root=tmp_path / "preempt") == known


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the package under ``root`` with that tree's pyproject.toml."""
    tool = shutil.which("lint-imports")
    if tool is None:
        pytest.skip("lint-imports is not installed (pip install -e '.[test]' installs import-linter)")
    env = {**os.environ, "PYTHONPATH": str(root)}  # the package under root, whatever is installed
    return subprocess.run(
        [tool, "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("module", "line", "contract", "chain"),
    [
        # a building block importing a part of the run
        ("checkpoint/commit.py", "from ..run import config", "The parts' layers", "preempt.checkpoint.commit ->"),
        # a run part importing a later one
        ("run/loop_state.py", "from . import stopping", "The run's parts", "preempt.run.loop_state ->"),
        # the CLI reaching torch through a module-level import
        ("cli/views.py", "import torch", "never import torch", "preempt.cli.views -> torch"),
    ],
    ids=["upward", "run-parts", "torch"],
)
def test_a_broken_contract_fails_lint_imports(tmp_path, module, line, contract, chain):
    shutil.copytree(PACKAGE, tmp_path / "preempt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    broken = tmp_path / "preempt" / module
    broken.write_text(broken.read_text() + f"\n{line}  # the import a contract forbids\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert contract in r.stdout and "BROKEN" in r.stdout and chain in r.stdout, r.stdout


def test_code_cites_no_issue_numbers_and_silences_the_type_checker_rarely():
    """History lives in git: the package and the tests cite no issue numbers. And ``# type: ignore`` stays rare
    (at most 10 in the package): a seam the type checker cannot follow is one to declare."""
    cited = re.compile(r"\bissues? ?#?\d+\b", re.IGNORECASE)
    found = [
        f"{p}:{i}"
        for p in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if cited.search(line) and p.name != "test_layout.py"
    ]
    assert not found, found
    ignores = sum(p.read_text().count("type: " + "ignore") for p in PACKAGE.rglob("*.py"))
    assert ignores <= 10, f"{ignores} type: ignore comments in preempt/"
