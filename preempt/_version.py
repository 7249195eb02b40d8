"""The package's version, a leaf: the manifest's provenance reads it without importing the package's face."""

__version__ = "0.1.0"
