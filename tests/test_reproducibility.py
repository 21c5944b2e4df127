"""The reproducibility contract (eagle3data.validate.reproducibility): a sample's states are a function of its
tokens, bit for bit, on vLLM-CPU; and the comparison that every run-against-run test uses.

The engine tests run the demo model on the same eight prompts, each computed alone, all in one call and
all in reverse order: through `engine.start_engine` (one request per engine step) every sample has the
same bits three times. Through plain vLLM (its default batching, requests queued before the first step,
so the batches do not depend on timing) some do not on a CPU with AMX tiles (with either MLA backend,
docs/resume.md): that is what the pipeline avoids. On a CPU without them (an AMD EPYC with AVX-512 BF16)
plain batching gave the same bits too, so that test runs only where AMX is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from eagle3data.validate.reproducibility import states_difference, ulp_distance

CAPTURES = [{"layer": 2, "point": "input"}, {"layer": 4, "point": "input"}, {"layer": 5, "point": "input"},
            {"layer": 7, "point": "output"}]
PROMPTS, ARRANGEMENTS = 8, {"alone": [[i] for i in range(8)], "together": [list(range(8))],
                            "reversed": [list(range(8))[::-1]]}

RUNNER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from eagle3data.engine import start as engine
    from eagle3bench.synthetic import random_prompts
    from eagle3data.contracts.layers import parse_captures
    from eagle3data.engine.start import EngineSettings

    if __name__ == "__main__":
        model, out, how, captures, arrangements = sys.argv[1], Path(sys.argv[2]), sys.argv[3], \\
            json.loads(sys.argv[4]), json.loads(sys.argv[5])
        settings = EngineSettings.with_defaults({"device": "cpu", "cpu_kv_cache_gib": 1, "max_num_batched_tokens": 1024,
                                  "max_num_seqs": 16})
        kwargs = engine.engine_kwargs(model, parse_captures(captures, 8), "bfloat16", 512, settings, False,
                                      str(out))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = engine.start_engine(kwargs, 1) if how == "pipeline" else LLM(**kwargs)
        prompts = list(random_prompts(8, 500, 900, seed=0, vary=True).values())

        def generate(ids, paths):
            llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], [SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": str(p)}})
                for p in paths], use_tqdm=False)

        for name, groups in arrangements.items():
            for group in groups:
                generate([prompts[i] for i in group], [out / name / f"{i}.safetensors" for i in group])
        generate([prompts[0][:8]], [out / "last.safetensors"])  # a further step: the files before it land
        wanted = [out / name / f"{i}.safetensors" for name in arrangements for i in range(8)]
        end = time.monotonic() + 120
        while not all(p.exists() for p in wanted) and time.monotonic() < end:
            time.sleep(0.1)
        print("FILES", sum(p.exists() for p in wanted), flush=True)
    """
)


def run_engine(model: Path, out: Path, how: str, env: dict) -> dict[str, list[torch.Tensor]]:
    """{arrangement: states of the 8 prompts}, computed by one engine started `how`."""
    script = out.parent / f"run_{how}.py"
    script.write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(script), str(model), str(out), how, json.dumps(CAPTURES),
                           json.dumps(ARRANGEMENTS)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env})
    assert proc.returncode == 0 and f"FILES {PROMPTS * len(ARRANGEMENTS)}" in proc.stdout, proc.stderr[-5000:]
    return {name: [load_file(str(out / name / f"{i}.safetensors"))["hidden_states"] for i in range(PROMPTS)]
            for name in ARRANGEMENTS}


@pytest.fixture(scope="module")
def pipeline_states(tiny_deepseek, tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    return run_engine(tiny_deepseek, tmp_path_factory.mktemp("pipeline") / "states", "pipeline", {})


def test_states_do_not_depend_on_batching_through_the_pipelines_engine(pipeline_states):
    for name in ("together", "reversed"):
        for i, (found, alone) in enumerate(zip(pipeline_states[name], pipeline_states["alone"])):
            assert states_difference(found, alone) is None, f"prompt {i}, {name}: {states_difference(found, alone)}"


@pytest.mark.slow
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="without AMX tiles vLLM-CPU's states did not depend on the batch (an AMD EPYC, "
                           "docs/resume.md): nothing for the pipeline to avoid on this CPU")
def test_plain_vllm_batching_changes_states_where_the_pipeline_avoids_it(tiny_deepseek, pipeline_states, tmp_path):
    # vLLM's own batching (in-process engine core: every request is queued before the first step).
    plain = run_engine(tiny_deepseek, tmp_path / "plain", "plain", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    for i, alone in enumerate(plain["alone"]):
        assert states_difference(alone, pipeline_states["alone"][i]) is None  # alone is alone, in either engine
    differing = [i for i, (found, alone) in enumerate(zip(plain["together"], plain["alone"]))
                 if states_difference(found, alone)]
    assert differing, ("vLLM-CPU's states no longer depend on the batch on this AMX CPU: one request per engine "
                       "step (engine.cpu_engine_kwargs) may no longer be needed")


def test_ulp_distance_counts_representable_values_across_zero():
    a = torch.tensor([1.0, 1.0, -1.0, 0.0, -0.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0078125, -1.0078125, -0.0, 0.0, -2.0], dtype=torch.bfloat16)
    two = (torch.tensor([2.0], dtype=torch.bfloat16).view(torch.int16).item())
    assert ulp_distance(a, b).tolist() == [0, 1, 1, 0, 0, 2 * two]
    assert ulp_distance(a.float(), b.float())[1].item() == 1 << 16  # fp32 has 16 more mantissa bits


def test_states_difference_says_how_many_values_differ_by_how_much_and_where():
    expected = torch.randn(5, 4, 16).to(torch.bfloat16)
    assert states_difference(expected.clone(), expected) is None
    found = expected.clone()
    found.view(torch.int16)[3, 2, 7] += 3
    message = states_difference(found, expected)
    assert "1 of 320 values differ" in message and "worst 3 units in the last place" in message
    assert "token 3, capture slot 2, column 7" in message
    assert "expected (5, 4, 16)" in states_difference(found[:4], expected)
