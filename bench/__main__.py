"""``python -m bench``: run the benchmark (see ``python -m bench --help``)."""

from bench.run import main

raise SystemExit(main())
