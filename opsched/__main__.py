"""``python -m opsched``: the ``opsched`` command, also from a checkout that is not installed."""

import sys

from opsched.cli import main

sys.exit(main())
