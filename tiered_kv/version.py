"""The package's version: the one place it is written (pyproject.toml reads it, ``tiered_kv.__version__`` and
``tiered-kv --version`` show it). CHANGELOG.md says what each version holds.

Threading contract: a constant.
"""
__version__ = "0.1.0"
