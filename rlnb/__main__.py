"""``python -m rlnb`` is the ``rlnb`` command."""

import sys

from rlnb.cli import main

sys.exit(main())
