"""``python -m amp_patch ...``: the ``amp-patch`` command."""
import sys

from .frontends.cli import main

if __name__ == "__main__":
    sys.exit(main())
