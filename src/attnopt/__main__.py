"""``python -m attnopt``: the same as the ``attnopt`` command."""
import sys

from attnopt.cli import main

sys.exit(main())
