"""The preflight's disk and time lines (`eagle3data.config.preflight.report`), in process: each enabled
export's cost as plan.disk states it (the dataset sized at the ratio measured for its precision), and a
time only where a measured run supports one."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, demo_config, with_defaults

from eagle3data.plan import measured
from eagle3data.config import preflight
from eagle3data.plan.disk import ExportShape, describe_export

SCHEMA = REPO / "config" / "schema.yaml"
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336}


def report(model, **overrides) -> str:
    config = with_defaults(demo_config(model={"path": str(model), "build_demo": False}, **overrides))
    text, problems = preflight.report(config, SCHEMA)
    assert not problems
    return text


def test_each_enabled_export_states_its_cost_and_a_measured_run_times_the_demo(tiny_deepseek):
    text = report(tiny_deepseek, export={"speculators": {"enabled": True}, "specforge": {"enabled": True}})
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("export ")}
    assert set(lines) == {"speculators", "specforge"}
    samples, tokens = (int(n.replace(",", "")) for n in
                       re.search(r"(\d+) samples, ([\d,]+) tokens", text).groups())
    shape = ExportShape(samples=samples, tokens=tokens, states_per_token=4, hidden_size=128, itemsize=2)
    dataset = round(float(re.search(r"states +([\d.]+) MiB", text).group(1)) * 2**20)  # codec none: raw
    for trainer, line in lines.items():  # the demo keeps its store: a speculators files export would link
        expected = describe_export(trainer, "reader", shape, dataset, linked=trainer == "speculators")
        assert line.split(" adds about ")[1].split(" (")[0] == expected.split(" adds about ")[1].split(" (")[0]
    assert "the exports and reserve_gib" in text
    # The demo's shape on a CPU was measured (the 2-core CPU benchmark): a time, from that run's rate.
    rate = measured.measured_rate("cpu", {"hidden_size": 128, "num_hidden_layers": 8, "intermediate_size": 256}, 1)
    line = next(line for line in text.splitlines() if line.startswith("time "))
    assert f"{rate.dataset_tps:,.0f} tok/s" in line and rate.hardware in line and rate.file in line


def test_an_fp8_dataset_is_planned_at_the_ratio_measured_for_fp8(tiny_deepseek):
    """storage.compression.precision fp8_e4m3: the preflight accepts it, names it among the settings that
    differ, and sizes the packed dataset at the storage benchmark's fp8 ratio, not the exact one's."""
    text = report(tiny_deepseek, storage={"compression": {"codec": "zstd", "precision": "fp8_e4m3"}},
                  export={"speculators": {"enabled": True}})
    assert 'storage.compression.precision: "fp8_e4m3" (default "exact")' in text
    states = float(re.search(r"states +([\d.]+) MiB", text).group(1))
    dataset = float(re.search(r"the packed dataset's ([\d.]+) MiB", text).group(1))
    assert measured.stored_ratio(precision="fp8_e4m3") < 0.8 * measured.stored_ratio()
    assert dataset == pytest.approx(states * measured.stored_ratio(precision="fp8_e4m3"), rel=0.05)


def test_no_time_without_a_measurement_of_that_shape_and_parallelism(tiny_deepseek):
    text = report(tiny_deepseek, engine={"tensor_parallel_size": 2})
    assert "time       not estimated: nothing measured supports it" in text and "tensor parallel 2" in text
    assert not any(line.startswith("export ") for line in text.splitlines())


def test_measured_rates_support_only_the_shape_machine_and_tp_measured():
    # The slowest run of that shape on that card: states of realistic entropy, not vLLM's dummy weights.
    h100 = measured.measured_rate("NVIDIA H100 80GB HBM3", LLAMA_8B, 1)
    assert h100.hardware == "1x H100, random normal(0, 0.02) weights, zstd" and h100.tokens > 1_000_000
    assert measured.measured_rate("NVIDIA H200", LLAMA_8B, 1, "none").hardware == "1x H200, dummy weights, raw"
    assert measured.measured_rate("NVIDIA H100 80GB HBM3", LLAMA_8B, 8) is None  # TP8: never measured
    assert measured.measured_rate("NVIDIA A100", LLAMA_8B, 1) is None
    kimi = {"hidden_size": 7168, "num_hidden_layers": 61, "intermediate_size": 18432}
    assert measured.measured_rate("NVIDIA H200", kimi, 1) is None
    assert measured.measured_rate("cpu", LLAMA_8B, 1) is None
