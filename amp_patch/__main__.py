"""``python -m amp_patch ...``: the ``amp-patch`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
