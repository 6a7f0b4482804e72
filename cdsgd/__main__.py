"""``python -m cdsgd`` is the ``cdsgd`` command."""

import sys

from .cli.commands import main

sys.exit(main())
