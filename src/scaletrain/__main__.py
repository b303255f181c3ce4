"""`python -m scaletrain ...`: the same as the `scaletrain` command (used by the launcher)."""

import sys

from scaletrain.cli import main

sys.exit(main())
