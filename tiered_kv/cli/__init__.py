"""The ``tiered-kv`` command line (``demo``, ``inspect``, ``bench``) and the disk benchmark behind ``bench``.

Threading contract: a command runs on the main thread.
"""
from tiered_kv.cli.main import main

__all__ = ["main"]
