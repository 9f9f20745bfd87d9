"""`python -m gateway` is the `tandem` command (API.md names both).

An entry point, not a library module: nothing imports it, so it may reach up to the `tandem`
package that wires every layer together (the import-contract test exempts `__main__` modules).
"""

import sys

from tandem.cli import main

sys.exit(main())
