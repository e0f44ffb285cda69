"""``python -m tiered_kv.cli``: the same as the ``tiered-kv`` command."""
import sys

from tiered_kv.cli.main import main

sys.exit(main())
