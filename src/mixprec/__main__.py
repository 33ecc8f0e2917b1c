"""``python -m mixprec``."""

from mixprec._cli import main

raise SystemExit(main())
