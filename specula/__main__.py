"""`python -m specula ...` is the same as the `specula` command."""

import sys

from specula.cli import main

sys.exit(main())
