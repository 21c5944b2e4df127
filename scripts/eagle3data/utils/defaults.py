"""The config's defaults, filled in from config/schema.yaml, the one place they are written, by the
validation that fills a run's config (Snakemake's, with `set_default`). Here, below every stage, so that
what is built by hand (tests, benchmarks, the CLI tools) takes a run's defaults without a copy of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from eagle3data.utils.checkout import REPO

SCHEMA = REPO / "config" / "schema.yaml"


def with_schema_defaults(config: dict, schema: str | Path = SCHEMA) -> dict:
    """`config`, validated and completed with the schema's defaults, as the workflow sees it."""
    from snakemake.utils import validate

    validate(config, str(schema), set_default=True)
    return config


def section_defaults(section: str, overrides: dict | None = None, schema: str | Path = SCHEMA) -> dict:
    """The config's `section` with `overrides`, completed with the schema's defaults."""
    config = {"input": "-", "model": {"path": "-"}, section: dict(overrides or {})}
    return with_schema_defaults(config, schema)[section]


class Section:
    """A config section typed: a subclass is a frozen dataclass with one field per key of the schema's
    section `NAME` (config/schema.yaml describes each), built from the validated config and read as
    attributes by the stage it configures. A key the schema gains and the class lacks fails every run."""

    NAME: ClassVar[str]

    @classmethod
    def from_config(cls, section: Mapping):
        """From a validated section (the schema's defaults applied: every key present)."""
        return cls(**section)

    @classmethod
    def with_defaults(cls, overrides: Mapping | None = None, schema: str | Path = SCHEMA):
        """The section with `overrides`, completed with the schema's defaults (tests, benchmarks, tools)."""
        return cls.from_config(section_defaults(cls.NAME, overrides, schema))
