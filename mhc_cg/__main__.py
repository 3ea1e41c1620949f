"""``python -m mhc_cg``: the ``mhc-cg`` command."""

import sys

from mhc_cg.cli import main

sys.exit(main())
