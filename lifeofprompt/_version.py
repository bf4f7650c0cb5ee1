"""The package's version, in one place: pyproject.toml reads it, ``__version__`` and ``env_info`` show it."""

__version__ = "0.1.0"
