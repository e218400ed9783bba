"""The package version (its own module, so that any stage can read it without importing
the package, and the build can read it without importing torch)."""

__version__ = "0.1.0"
