"""Where the checkout's own files lie (config/, docs/, data/, the Snakefile): the package runs from its
source tree, and the schema, the measurements and the benchmarks' inputs are read from there.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
