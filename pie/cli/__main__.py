"""`python -m pie.cli`: the same as the `pie` command."""

import sys

from pie.cli import main

sys.exit(main())
