"""The package's version, its one source (pyproject.toml reads it when building), and a leaf: the manifest's
provenance and ``preempt --version`` read it without importing the package's face."""

__version__ = "0.2.0"
