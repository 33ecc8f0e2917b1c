"""``python -m bench``: the whole bench (:mod:`bench.main`)."""

import sys

from bench.main import main

sys.exit(main())
