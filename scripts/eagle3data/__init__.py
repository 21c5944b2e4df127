"""eagle3data: turn chat datasets into EAGLE-3 training data (target-model hidden states).

The library behind the Snakemake workflow; `open_dataset` reads what the pipeline packs, and
`decode_states` turns a row's `hidden_states` as `datasets.load_from_disk` returns it into the bf16
tensor (with `read_metadata` of the dataset). They are imported on first use: the Snakefile imports this
package to plan, and torch and `datasets` cost seconds there.
"""

__all__ = ["open_dataset", "decode_states", "read_metadata"]


def __getattr__(name: str):
    if name in __all__:
        from eagle3data.dataset import format as dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'eagle3data' has no attribute {name!r}")
