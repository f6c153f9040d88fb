import sys

from kvgate.cli import main

# Guarded: a multiprocessing child (the scan's header reader) may import the main module.
if __name__ == "__main__":
    sys.exit(main())
