"""``python -m mixprec``."""

from mixprec.cli.main import main

raise SystemExit(main())
