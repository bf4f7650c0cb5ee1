"""``python -m lifeofprompt ...``: hands the command line to ``cli.main``."""

import sys

from .cli import main

sys.exit(main())
