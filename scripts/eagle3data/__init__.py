"""eagle3data: turn chat datasets into EAGLE-3 training data (target-model hidden states).

The library behind the Snakemake workflow; `open_dataset` reads what the pipeline packs.
"""

from eagle3data.dataset import open_dataset

__all__ = ["open_dataset"]
