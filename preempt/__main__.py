"""``python -m preempt ...``: the same command line as the ``preempt`` console script."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
