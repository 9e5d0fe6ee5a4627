"""``python -m dtrain_magic``: the command line (`dtrain_magic.cli`)."""

import sys

from .cli import main

sys.exit(main())
