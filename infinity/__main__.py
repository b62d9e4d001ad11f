"""`python -m infinity ...` is the `infinity` command."""

import sys

from infinity.tools.cli import main

sys.exit(main())
