"""``python -m cdsgd`` is the ``cdsgd`` command."""

import sys

from .cli import main

sys.exit(main())
