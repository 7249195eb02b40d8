"""What the project says about installing it: the distribution is preempt-torch, the import and the command preempt.

The package index's ``preempt`` is an unrelated project, so an install line that names it installs a stranger's code.
Every doc, message, example and template of the tree is read here, and one that says ``pip install preempt`` or
``'preempt[...]'`` again fails this test with the file and the line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "preempt-torch"

# ``pip install [options] preempt`` or ``preempt[extra]`` (quoted or not), never ``preempt-torch``/``preempt_x``
_INDEX_NAME = re.compile(
    r"pip3?\s+install(?:\s+-\S+)*\s+['\"]?preempt(?![\w-])"  # pip install [-U] preempt, 'preempt[hf]'
    r"|(?<![\w-])preempt\[(?:[\w,{} ]+)\]"  # an extra of the index's name anywhere: 'preempt[plot]', preempt[{x}]
)
_TEXT = {".md", ".py", ".sh", ".sbatch", ".toml", ".txt", ".yaml", ".yml", ".cfg", ".ini"}
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "build", "dist", "runs"}


def _texts() -> list[Path]:
    """The tree's docs, sources, examples, templates and scripts (what a user reads or runs), this file aside."""
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in _TEXT or rel.as_posix() == ".ci/run") and path != Path(__file__):
            out.append(path)
    return out


def offenders(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of ``text`` that names the index's ``preempt`` as something to install."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if _INDEX_NAME.search(line)]


@pytest.mark.parametrize(
    "line",
    [
        "pip install preempt",
        "pip install -U preempt",
        "run `pip install 'preempt[plot]'` first",
        'pip install "preempt[lightning,hf]"',
        "``'preempt[wandb]'``",
        "f\" pip install 'preempt[{package}]'\"",
    ],
)
def test_the_index_name_is_caught(line: str) -> None:
    assert offenders(line), line


@pytest.mark.parametrize(
    "line",
    [
        "pip install preempt-torch",
        "pip install 'preempt-torch[plot]'",
        "pip install -e '.[lightning]'",
        "pip install nvidia-ml-py): preempt saves",
        'logging.getLogger("preempt")',
        "from preempt import PreemptibleRun",
    ],
)
def test_our_lines_pass(line: str) -> None:
    assert not offenders(line), line


def test_no_doc_message_example_or_template_installs_the_index_preempt() -> None:
    files = _texts()
    # the places that tell users what to install are all read
    rels = {p.relative_to(ROOT).as_posix() for p in files}
    assert {"README.md", "README_PREEMPTION.md", "preempt/cli/plot.py", "examples/demo.sh", ".ci/run"} <= rels
    assert any(r.startswith("slurm/") and r.endswith(".sbatch") for r in rels)
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line}" for p in files for n, line in offenders(p.read_text(errors="replace"))
    ]
    assert not found, f"install lines name the index's unrelated `preempt`; say {DISTRIBUTION}:\n" + "\n".join(found)


def test_the_distribution_is_ours_and_the_import_and_command_preempt() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    assert project["scripts"] == {"preempt": "preempt.cli.main:main"}
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {DISTRIBUTION}" in readme


def test_one_version_read_by_the_build_the_command_and_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "preempt._version.__version__"}
    from preempt import __version__
    from preempt.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {__version__} (" in changelog, f"CHANGELOG.md has no section for {__version__}"


def test_a_complete_package_license_types_and_classifiers() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (
        "Apache License" in (ROOT / "LICENSE").read_text()
        and "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    )
    assert (ROOT / "preempt" / "py.typed").is_file()
    assert "Typing :: Typed" in project["classifiers"]
    # PEP 639: a license expression and a License :: classifier together are refused by the build
    assert not any(c.startswith("License ::") for c in project["classifiers"])


@pytest.mark.parametrize(
    ("row", "extra", "package"),
    [
        ("torch", None, "torch"),
        ("Lightning", "lightning", "lightning"),
        ("transformers", "hf", "transformers"),
        ("Accelerate", "hf", "accelerate"),
    ],
)
def test_the_readme_table_allows_what_pyproject_allows(row: str, extra: str | None, package: str) -> None:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    (wanted,) = [r.specifier for d in deps if (r := Requirement(d)).name == package]
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith(f"| {row} | "))
    allowed = line.split("|")[2].split("(")[0].replace(" ", "")
    assert SpecifierSet(allowed) == wanted, f"README.md says {row} {allowed}, pyproject.toml {wanted}"
