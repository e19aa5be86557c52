"""``python -m graphprune``: see ``python -m graphprune --help`` (``_cli.py``)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
