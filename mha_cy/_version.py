"""Single source of the package version (read statically by setuptools)."""

__version__ = "0.1.0"
