"""``python -m ortrain``: the ``ortrain`` command (see :mod:`ortrain.cli`)."""

from ortrain.cli import main

raise SystemExit(main())
