"""eagle3data: turn chat datasets into EAGLE-3 training data (target-model hidden states).

The library behind the Snakemake workflow; `open_dataset` reads what the pipeline packs. It is imported
on first use: the Snakefile imports this package to plan, and torch and `datasets` cost seconds there.
"""

__all__ = ["open_dataset"]


def __getattr__(name: str):
    if name == "open_dataset":
        from eagle3data.dataset import open_dataset

        return open_dataset
    raise AttributeError(f"module 'eagle3data' has no attribute {name!r}")
