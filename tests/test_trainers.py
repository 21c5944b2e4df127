"""The packed demo dataset feeds real EAGLE-3 trainers: speculators 0.9 trains on its export (on CPU, via
eagle3bench.speculators_cpu), SpecForge 0.2 trains on its export (on CPU, via
eagle3bench.specforge_train), SpecForge's offline reader reads its export tensor for tensor as the packed
dataset holds them, and both libraries accept the pipeline's draft vocabulary.

The trainers are test-only dependencies (envs/setup.sh installs them with --no-deps, keeping this torch).
All checks run on the session's demo run; one copy of it is brought up to date with both exports enabled
at their defaults (the trainers read the packed states in place), another with both writing files.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import demo_config, run_snakemake
from safetensors.torch import load_file

from eagle3data import open_dataset
from eagle3bench import muon_cpu
from eagle3bench.stages import footprint
from eagle3data.storage.store import sample_path
from eagle3data.exports.trainers import SPECULATORS, ExportRefused, layout

RUN = "results/demo"
MODEL = "resources/demo-model"
BOTH = {"speculators": {"enabled": True}, "specforge": {"enabled": True}}
FILES = {name: {"enabled": True, "states": "files"} for name in BOTH}


def exported_copy(demo_run: Path, tmp_path_factory, name: str, exports: dict) -> tuple[Path, str]:
    """A copy of the demo run, re-run with `exports`: (its directory, Snakemake's output)."""
    run = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(demo_run, run, symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    proc = run_snakemake(run, config=demo_config(export=exports))
    return run, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def exported(demo_run, tmp_path_factory) -> tuple[Path, str]:
    """Both exports enabled at their defaults: the trainers read the packed dataset in place."""
    return exported_copy(demo_run, tmp_path_factory, "exported", BOTH)


@pytest.fixture(scope="module")
def files_exported(demo_run, tmp_path_factory) -> Path:
    """Both exports enabled with `states: files`, as the trainers' own readers load them."""
    return exported_copy(demo_run, tmp_path_factory, "files-exported", FILES)[0]


def test_vocab_is_counted_over_trainable_tokens_and_agrees_with_both_trainers(demo_run):
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = Counter()
    for row in open_dataset(demo_run / RUN / "dataset"):
        counts.update(row["input_ids"][row["loss_mask"] == 1].tolist())
    token_freq = torch.load(demo_run / RUN / "token_freq.pt", weights_only=True)
    assert token_freq == dict(counts)
    mapping = torch.load(demo_run / RUN / "vocab_mapping.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, draft_vocab_size=256, target_vocab_size=950)
    assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)
    validate_vocab_mapping_consistency(mapping["t2d"], mapping["d2t"])  # SpecForge's own check


def test_dataset_card_states_each_trainers_settings(demo_run):
    dataset = demo_run / RUN / "dataset"
    trainers = open_dataset(dataset).metadata["trainers"]
    wanted = ("layer_ids", "aux_slots", "final_state", "final_state_source_slot", "hidden_size", "dtype")
    assert [trainers["speculators"][k] for k in wanted] == [[2, 4, 5], [0, 1, 2], "pre_norm", 3, 128,
                                                            "bfloat16"]
    assert [trainers["specforge"][k] for k in wanted] == [[1, 3, 4], [0, 1, 2], "post_norm", 3, 128,
                                                          "bfloat16"]
    card = (dataset / "README.md").read_text()
    assert "`--target-layer-ids 2 4 5`" in card and "`model.aux_hidden_state_layer_ids: [1, 3, 4]`" in card
    assert "before the final norm" in card and "after the final norm" in card and "Hidden size 128" in card
    # What a receiver can check: the run's parity verdict with its numbers, and the full byte check.
    parity = open_dataset(dataset).metadata["parity"]
    assert f"- Parity gate: passed, {parity['samples']} samples of 3 shards" in card
    assert f"worst median error {parity['final_capture']['worst_median']}" in card
    assert "python -m eagle3data.dataset.check --full DIR" in card


def test_exports_are_rules_outside_the_default_target_until_enabled(demo_run, exported):
    assert not (demo_run / RUN / "export").exists()
    run, log = exported
    ran = set(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", log))
    assert ran == {"export_speculators", "export_specforge", "all"}, log[-4000:]
    for name, ids in (("speculators", [2, 4, 5]), ("specforge", [1, 3, 4])):
        manifest = json.loads((run / RUN / "export" / name / "eagle3_export.json").read_text())
        assert (manifest["samples"], manifest["layer_ids"], manifest["aux_captures"]) == (
            20, ids, ["layer2_input", "layer4_input", "layer5_input"])
        assert manifest["hidden_states_backend"] == "eagle3data"  # the default: read in place


def test_both_exports_at_their_defaults_cost_at_most_a_tenth_of_the_packed_dataset(exported, files_exported):
    """Each file either export holds that nothing else in the run holds (a hard link is free), against
    the packed dataset's bytes on disk; `states: files` for comparison (the states again, decompressed
    where the dataset is compressed). Each export's log states what it costs and what the other would."""
    run, _ = exported
    by_default, with_files = footprint(run / RUN), footprint(files_exported / RUN)
    assert by_default["dataset_bytes"] == with_files["dataset_bytes"] > 0
    ratio = (by_default["dataset_bytes"] + by_default["exports_own_bytes"]) / by_default["dataset_bytes"]
    assert ratio <= 1.1, by_default
    # speculators' files are the store's (linked), SpecForge's are the states again, its final one normed.
    assert with_files["exports_own_bytes"] > 0.9 * with_files["dataset_bytes"], with_files
    for name in ("speculators", "specforge"):
        log = (run / RUN / "logs" / f"export_{name}.log").read_text()
        planned = re.search(rf"the {name} export \(states: reader\) adds about [\d.]+ MiB to the run "
                            r"\(([\d.]+)x the packed dataset's [\d.]+ MiB\); states: files would add about", log)
        added = re.search(rf"the {name} export added [\d.]+ MiB \(([\d.]+)x the packed dataset\)", log)
        assert planned and added, log[-2000:]
        assert float(added[1]) <= float(planned[1]) + 0.005, (planned[0], added[0])  # the plan is an upper bound


def test_the_speculators_export_links_the_stores_files_instead_of_copying_them(files_exported):
    """Its default slots are the dataset's own, so each hs_{i}.safetensors is the store's file of row i."""
    run = files_exported
    ds = open_dataset(run / RUN / "dataset")
    exported_files = run / RUN / "export" / "speculators" / "hidden_states"
    stores = list((run / RUN / "states").iterdir())
    assert len(stores) == 1
    for i in range(len(ds)):
        linked = exported_files / f"hs_{i}.safetensors"
        stored = sample_path(stores[0], ds[i]["sample_id"])
        assert linked.stat().st_ino == stored.stat().st_ino and linked.stat().st_nlink == 2, (linked, stored)


@pytest.mark.slow
def test_speculators_trains_on_its_export_on_cpu(files_exported, tmp_path):
    """export.speculators.states: files, read by speculators' own file backend (the default export trains
    through the eagle3data backend below)."""
    run = files_exported
    data = run / RUN / "export" / "speculators"
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3bench.speculators_cpu", str(metrics),
         "--verifier-name-or-path", str(run / MODEL), "--data-path", str(data), "--speculator-type", "eagle3",
         "--target-layer-ids", "2", "4", "5", "--draft-vocab-size", "256", "--total-seq-len", "512",
         "--num-workers", "0", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
         "--hidden-states-dtype", "float32", "--on-missing", "raise", "--epochs", "4", "--lr", "1e-3",
         "--save-path", str(tmp_path / "draft")],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r["train"] for r in records if "train" in r]
    val = [r["val"]["loss_epoch"] for r in records if "val" in r]
    assert len(train) >= 24 and len(val) == 4
    # The trainer only warns and drops a row whose hidden-state token ids differ from its input ids.
    assert [t["error_records"] for t in train] == [0.0] * len(train)
    assert "match input ids" not in output
    assert val[-1] < 0.95 * val[0], f"validation loss by epoch: {val}"
    # Muon's bf16 step goes through float32 products exactly where the CPU has no bf16 instructions.
    assert ("Muon's Newton-Schulz in float32" in output) != muon_cpu.bf16_matmul_is_native(), output[-3000:]


@pytest.mark.slow
def test_specforge_trains_on_its_export_on_cpu(exported, tmp_path):
    """SpecForge 0.2's own trainer, on CPU through eagle3bench.specforge_train (DDP, its loss in eager
    torch), trains a draft from the export with validation loss falling, and `specforge export --to sglang`
    writes the draft vLLM loads as `eagle3`: the export's draft vocabulary and mapping, its aux layers in
    vLLM's numbering."""
    from eagle3bench.acceptance_specforge import train_specforge
    from eagle3bench.acceptance_train import Recipe

    run, _ = exported
    export = run / RUN / "export" / "specforge"
    samples = len(list((export / "hidden_states").glob("*.ckpt")))
    recipe = Recipe(epochs=4, lr=3e-3, draft_vocab=256, total_seq_len=512)
    trained = train_specforge(export, samples - 4, 4, run / MODEL, recipe, tmp_path / "e", tmp_path / "train.log")
    # The demo target's random weights leave little to learn (2.974, 2.950, 2.941, 2.940 measured): the
    # loss on the held-out rows falls every epoch.
    losses = [e["eval/avg_loss"] for e in trained["val_by_epoch"]]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), f"validation loss by epoch: {losses}"
    assert trained["steps"] == 4 * (samples - 4)
    draft = Path(trained["draft"])
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # SpecForge's 1, 3, 4
    mapping, weights = torch.load(export / "vocab_mapping.pt"), load_file(draft / "model.safetensors")
    assert torch.equal(weights["d2t"], mapping["d2t"]) and torch.equal(weights["t2d"], mapping["t2d"])


def test_the_reader_export_holds_no_states_and_speculators_reads_the_packed_ones(exported, files_exported,
                                                                                 tmp_path):
    """export.speculators.states: reader (the default). speculators' own ArrowDataset, given the eagle3data
    backend, yields exactly the samples its own file backend yields from the files export, and its CLI
    trains one epoch through that backend."""
    from hs_connectors.transfer import FileTransfer
    from speculators.train.data import ArrowDataset

    from eagle3data.exports.speculators_reader import PackedStatesTransfer

    run, _ = exported
    reader, files = run / RUN / "export" / "speculators", files_exported / RUN / "export" / "speculators"
    assert not (reader / "hidden_states").exists()
    options = {"max_len": 512, "on_missing": "raise", "hidden_states_dtype": torch.float32}
    expected = ArrowDataset(datapath=files, transfer=FileTransfer(files / "hidden_states"), **options)
    found = ArrowDataset(datapath=reader, transfer=PackedStatesTransfer(reader), **options)
    assert len(found) == len(expected) == len(open_dataset(run / RUN / "dataset"))
    for i in range(len(expected)):
        a, b = expected[i], found[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i
    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3bench.speculators_cpu", str(metrics),
         "--verifier-name-or-path", str(run / MODEL), "--data-path", str(reader), "--speculator-type", "eagle3",
         "--hidden-states-backend", "eagle3data", "--target-layer-ids", "2", "4", "5", "--draft-vocab-size", "256",
         "--total-seq-len", "512", "--num-workers", "0", "--draft-attn-impl", "sdpa", "--loss-implementation",
         "eager", "--hidden-states-dtype", "float32", "--on-missing", "raise", "--epochs", "1",
         "--save-path", str(tmp_path / "draft")],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    train = [json.loads(line)["train"] for line in metrics.read_text().splitlines() if '"train"' in line]
    assert train and [t["error_records"] for t in train] == [0.0] * len(train)


def test_specforge_offline_reader_reads_exactly_the_packed_tensors(files_exported):
    """export.specforge.states: files, read by SpecForge's own loader."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.training.vocab_mapping import count_effective_feature_tokens
    from transformers import AutoModelForCausalLM

    run = files_exported
    export = run / RUN / "export" / "specforge"
    rows = list(open_dataset(run / RUN / "dataset"))
    features = str(export / "hidden_states")
    refs = OfflineManifestReader(features, run_id="t", max_len=512, validate_files=True).read()
    assert len(refs) == len(rows)
    for ref, row in zip(refs, rows):
        length = len(row["input_ids"])
        assert ref.feature_specs["aux_hidden_state"].shape == (1, length, 3 * 128)
        assert ref.feature_specs["hidden_state"].shape == (1, length, 128)
    norm = AutoModelForCausalLM.from_pretrained(str(run / MODEL), dtype=torch.float32).model.norm
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, collate_fn=build_offline_collator(),
                               per_sample_transform=build_offline_normalizer(512), strategy="eagle3")
    seen = 0
    for batch in loader:
        row = rows[int(batch.sample_ids[0].split(":")[1])]
        got, states = batch.tensors, row["hidden_states"]
        assert torch.equal(got["input_ids"][0], row["input_ids"])
        assert torch.equal(got["loss_mask"][0, :-1], row["loss_mask"][:-1])  # SpecForge zeroes the last
        assert torch.equal(got["hidden_state"][0], states[:, :3, :].reshape(len(states), -1))
        with torch.no_grad():
            assert torch.equal(got["target"][0], norm(states[:, 3, :].float()).to(torch.bfloat16))
        seen += 1
    assert seen == len(rows)
    token_freq = torch.load(run / RUN / "token_freq.pt", weights_only=True)
    assert dict(count_effective_feature_tokens(features, target_vocab_size=950)) == token_freq
    assert torch.equal(torch.load(export / "vocab_mapping.pt")["d2t"],
                       torch.load(run / RUN / "vocab_mapping.pt")["d2t"])


def test_the_specforge_reader_export_holds_pointers_and_specforge_reads_the_packed_rows(exported, files_exported):
    """export.specforge.states: reader (the default). Through eagle3data.exports.specforge_reader, SpecForge's
    own offline reader, feature store and loader yield from the pointer export exactly the batches they
    yield from the files export, and SpecForge counts the same tokens for its draft vocabulary."""
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    from eagle3data.exports.specforge_reader import install

    run, _ = exported
    reader, files = run / RUN / "export" / "specforge", files_exported / RUN / "export" / "specforge"
    install()

    def batches(export: Path) -> dict:
        features = str(export / "hidden_states")
        refs = OfflineManifestReader(features, run_id="t", max_len=512, validate_files=True).read()
        loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, collate_fn=build_offline_collator(),
                                   per_sample_transform=build_offline_normalizer(512), strategy="eagle3")
        return {batch.sample_ids[0]: batch.tensors for batch in loader}

    expected, found = batches(files), batches(reader)
    assert len(found) == len(expected) == len(open_dataset(run / RUN / "dataset"))
    for sample, tensors in expected.items():
        got = found[sample]
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors), sample
    assert count_effective_feature_tokens(str(reader / "hidden_states"), target_vocab_size=950) == \
        count_effective_feature_tokens(str(files / "hidden_states"), target_vocab_size=950)


def export_cli(run: Path, trainer: str, out: Path, *layer_ids: int) -> subprocess.CompletedProcess:
    extra = (["--token-freq", f"{RUN}/token_freq.pt"] if trainer == "speculators" else ["--model", MODEL])
    return subprocess.run(
        [sys.executable, "-m", f"eagle3data.export_{trainer}", f"{RUN}/dataset", str(out), *extra,
         "--vocab-mapping", f"{RUN}/vocab_mapping.pt", "--layer-ids", *map(str, layer_ids), "--states", "files"],
        capture_output=True, text=True, timeout=300, cwd=run)


def test_layer_ids_are_renamed_when_exact_and_refused_when_not(demo_run, tmp_path):
    # Outputs of layers 2, 3, 4 (SpecForge ids) are the inputs of layers 3, 4, 5: the dataset has 4 and 5,
    # not 3.
    proc = export_cli(demo_run, "specforge", tmp_path / "sf", 2, 3, 4)
    assert proc.returncode == 1 and not (tmp_path / "sf").exists()
    assert ("specforge: layer id 2 (id k = output of decoder layer k, SGLang's numbering) is vLLM aux id 3, "
            "which the dataset did not capture") in proc.stderr
    assert "Use ids [1, 3, 4] for this data" in proc.stderr
    proc = export_cli(demo_run, "specforge", tmp_path / "sf", 1, 3)
    assert proc.returncode == 1 and "expected exactly 3 aux layer ids, found 2" in proc.stderr
    # Another order of captured layers is exact: slots follow the trainer's order.
    proc = export_cli(demo_run, "speculators", tmp_path / "sp", 5, 2, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = open_dataset(demo_run / RUN / "dataset")[0]
    written = load_file(str(tmp_path / "sp" / "hidden_states" / "hs_0.safetensors"))
    assert torch.equal(written["hidden_states"], row["hidden_states"][:, [2, 0, 1, 3], :])
    assert torch.equal(written["token_ids"], row["input_ids"])
    proc = export_cli(demo_run, "speculators", tmp_path / "sp", 2, 4, 5)
    assert proc.returncode == 1 and "exports never overwrite" in proc.stderr


def test_a_dataset_without_the_pre_norm_final_state_is_refused(demo_run):
    meta = open_dataset(demo_run / RUN / "dataset").metadata
    with pytest.raises(ExportRefused, match=r"needs the verifier's final hidden state \(output of decoder "
                                            r"layer 7, vLLM aux id 8\); the dataset holds only layer2_input"):
        layout(SPECULATORS, {**meta, "captures": meta["captures"][:3]})
    post_norm = [*meta["captures"][:3], {**meta["captures"][3], "final_norm_applied": True}]
    with pytest.raises(ExportRefused, match="holds it after the norm, which cannot be undone exactly"):
        layout(SPECULATORS, {**meta, "captures": post_norm})
