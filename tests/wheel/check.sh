#!/usr/bin/env bash
# The wheel is what users install: build the sdist and the wheel from this checkout, check their metadata and what
# they hold, install the wheel into a fresh virtual environment (no system site-packages, so neither the checkout
# nor an editable install of it can be imported there) and use it from a folder outside the checkout:
# `preempt --version`, the quick start's loop stopped by SIGTERM and resumed, equal under torch.equal to an
# uninterrupted run, and `preempt ls` / `preempt verify` on its save_dir. Run by .ci/run; by hand:
#
#     tests/wheel/check.sh [WORK_DIR]     # default: a temporary folder, removed at the end
#
# torch in the venv: the release this Python has (`pip install torch==X.Y.Z`, which on this workplace's machines is
# the local CPU wheel of pip's find-links), else PREEMPT_WHEEL_TORCH.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${1:-}" ]; then work=$(mkdir -p "$1" && cd "$1" && pwd); else work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi
case "$work/" in "$repo"/*) echo "WORK_DIR must lie outside the checkout ($repo)" >&2; exit 2 ;; esac
started=$SECONDS
say() { echo "[wheel $((SECONDS - started)) s] $*"; }

# 1. the sdist and the wheel, built as a user's pip would (an isolated build environment), and their metadata
rm -rf "$work/dist"
python -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || { cat "$work/build.log" >&2; exit 1; }
python -m twine check --strict "$work"/dist/*
wheel=$(echo "$work"/dist/*.whl)
say "built $(cd "$work/dist" && echo *)"

# 2. what they hold: every module of the checkout's package, py.typed, the license, the metadata
python - "$repo" "$work/dist" <<'PY'
import sys, tarfile, zipfile
from email.parser import Parser
from pathlib import Path

repo, dist = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = dist.glob("*.whl")
(sdist,) = dist.glob("*.tar.gz")
names = set(zipfile.ZipFile(wheel).namelist())
wanted = {p.relative_to(repo).as_posix() for p in (repo / "preempt").rglob("*.py") if "__pycache__" not in p.parts}
wanted.add("preempt/py.typed")
missing = sorted(wanted - names)
assert not missing, f"{wheel.name} lacks {missing}"
info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
assert f"{info}/licenses/LICENSE" in names, f"{wheel.name}: no {info}/licenses/LICENSE"
meta = Parser().parsestr(zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode())
assert meta["Name"] == "preempt-torch", meta["Name"]
assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
assert "preempt = preempt.cli.main:main" in entry, entry
top = {n.split("/")[0] for n in names if not n.startswith(info)}
assert top == {"preempt"}, f"{wheel.name} installs {sorted(top)}, expected only the preempt package"
with tarfile.open(sdist) as tar:
    held = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
for name in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "preempt/py.typed"):
    assert name in held, f"{sdist.name} lacks {name}"
print(f"{wheel.name}: {len(wanted)} files of preempt/, LICENSE, py.typed; version {meta['Version']}")
PY
version=$(basename "$wheel" | cut -d- -f2)  # NAME-VERSION-TAGS.whl

# 3. a fresh venv holding torch and the wheel (its other dependencies from the index)
torch_version=${PREEMPT_WHEEL_TORCH:-$(python -c 'import torch; print(torch.__version__.split("+")[0])')}
rm -rf "$work/venv"
python -m venv "$work/venv"
venv_python=$work/venv/bin/python
"$venv_python" -m pip install -q "torch==$torch_version"
"$venv_python" -m pip install -q "$wheel"
say "installed torch $torch_version and $(basename "$wheel") in $work/venv"

# 4. used from a folder outside the checkout
mkdir -p "$work/use" && cd "$work/use"
rm -rf straight stopped ./*.pt
cp "$repo/tests/wheel/loop.py" .
"$venv_python" - "$work/venv" <<'PY'
import sys
from pathlib import Path

import preempt

where = Path(preempt.__file__).resolve()
assert where.is_relative_to(Path(sys.argv[1]).resolve()), f"preempt imported from {where}, not the venv"
assert (where.parent / "py.typed").is_file(), "py.typed is not installed"
PY
out=$("$work/venv/bin/preempt" --version)
[ "$out" = "preempt $version" ] || { echo "preempt --version said '$out', expected 'preempt $version'" >&2; exit 1; }

"$venv_python" loop.py --save_dir straight --out straight.pt
set +e
"$venv_python" loop.py --save_dir stopped --out stopped.pt --stop_at 21
code=$?
set -e
[ "$code" = 75 ] || { echo "the loop stopped by SIGTERM exited $code, expected 75" >&2; exit 1; }
[ ! -e stopped.pt ] || { echo "the stopped loop went on to the end" >&2; exit 1; }
"$venv_python" loop.py --save_dir stopped --out stopped.pt
"$venv_python" - <<'PY'
import torch

straight, resumed = torch.load("straight.pt"), torch.load("stopped.pt")
assert straight.keys() == resumed.keys(), sorted(straight.keys() ^ resumed.keys())
unequal = [k for k in straight if not torch.equal(straight[k], resumed[k])]
assert not unequal, f"stopped at step 21 and resumed, these differ from the uninterrupted run: {unequal}"
print(f"resumed run equals the uninterrupted one: {len(straight)} tensors under torch.equal")
PY
"$work/venv/bin/preempt" ls stopped
"$work/venv/bin/preempt" verify stopped
say "ok: preempt-torch $version from its wheel, outside the checkout"
