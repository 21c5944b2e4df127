"""`python -m eagle3bench`: the benchmark command (eagle3bench.figures)."""

import sys

from eagle3bench.figures import main

sys.exit(main())
