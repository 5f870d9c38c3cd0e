"""``python -m kdtree_engine``: the ``kdtree`` command."""

import sys

from .cli import main

sys.exit(main())
