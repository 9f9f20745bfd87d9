"""`python -m gateway` is the `tandem` command."""

import sys

from gateway.cli import main

sys.exit(main())
