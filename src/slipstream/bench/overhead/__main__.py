"""``python -m slipstream.bench.overhead``: see :mod:`slipstream.bench.overhead.cli`."""

from .cli import main

raise SystemExit(main())
