"""`python -m a2ad` is the `a2ad` command."""

import sys

from a2ad.tools.cli import main

sys.exit(main())
