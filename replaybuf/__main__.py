"""``python -m replaybuf inspect DIR`` / ``verify DIR``: see :mod:`replaybuf.cli`."""

from replaybuf.cli import main

raise SystemExit(main())
