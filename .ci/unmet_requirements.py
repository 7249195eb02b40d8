"""Print the requirements of a release installed in a folder of its own that this environment does not meet.

usage: python .ci/unmet_requirements.py DIR PACKAGE [EXTRA...]

.ci/run tests the oldest release of a framework by putting it in DIR, first on PYTHONPATH, beside the newest releases
of everything else. transformers checks its dependencies' versions when imported (tokenizers, huggingface-hub) and
uses some optional ones when installed (kernels), so its oldest release needs the releases of those it asks for in
DIR too: one requirement a line, for ``pip install --no-deps --target DIR``. Only PACKAGE's own requirements and those
of the EXTRAs named; an EXTRA's requirement only where this environment holds that package at a version it refuses.
torch is never printed: the matrix tests torch's range apart (torch_run), and a second torch is gigabytes.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement


def unmet(folder: str, package: str, extras: list[str]) -> list[str]:
    dist = next(iter(md.distributions(name=package, path=[folder])), None)
    if dist is None:
        raise SystemExit(f"{folder}: no {package} installed there")
    out: dict[str, str] = {}
    for text in dist.requires or []:
        req = Requirement(text)
        base = req.marker is None or req.marker.evaluate({"extra": ""})
        wanted = base or any(req.marker.evaluate({"extra": e}) for e in extras)  # type: ignore[union-attr]
        if not wanted or req.name in out or req.name == "torch":
            continue
        try:
            found: str | None = md.version(req.name)  # this environment's, not DIR's (DIR is not on sys.path)
        except md.PackageNotFoundError:
            found = None
        if (found is None and base) or (found is not None and not req.specifier.contains(found, prereleases=True)):
            out[req.name] = f"{req.name}{req.specifier}"
    return list(out.values())


if __name__ == "__main__":
    print("\n".join(unmet(sys.argv[1], sys.argv[2], sys.argv[3:])))
