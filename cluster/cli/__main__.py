"""``python -m cluster.cli``: the `edgefleet` command."""

import sys

from cluster.cli import main

sys.exit(main())
