"""`python -m eagle3data.bench`: the benchmark command (eagle3data.bench.figures)."""

import sys

from eagle3data.bench.figures import main

sys.exit(main())
