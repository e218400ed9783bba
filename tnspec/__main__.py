"""``python -m tnspec`` is the ``tnspec`` command."""
import sys

from .cli import main

sys.exit(main())
