"""``python -m PACKAGE BUNDLE``: the bundle's runner as a command (``bundle.main``)."""

import sys

from .bundle import main

if __name__ == "__main__":
    sys.exit(main())
