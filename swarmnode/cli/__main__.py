"""`python -m swarmnode.cli …`: the `swarmnode` command."""

import sys

from swarmnode.cli.main import main

sys.exit(main())
