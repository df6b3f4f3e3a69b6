"""``python -m commsim.cli``: the same as the ``commsim`` command."""

import sys

from commsim.cli import main

sys.exit(main())
