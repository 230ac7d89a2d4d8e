"""The package version (one place: ``tcprec.__version__`` and ``tcprec info`` read it)."""

__version__ = "0.1.0"
