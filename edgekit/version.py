"""The package version (one place; the root package and build bundles read it)."""

__version__ = "0.1.0"
