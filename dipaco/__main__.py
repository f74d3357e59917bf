"""`python -m dipaco ...` (and `torchrun -m dipaco ...`) run the CLI."""

import sys

from dipaco.cli import main

sys.exit(main())
