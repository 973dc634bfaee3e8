"""``python -m exporter``: the same as the ``cache-config-exporter`` command."""

from exporter.cli import main

raise SystemExit(main())
