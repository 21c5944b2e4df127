"""The dataset card: README.md inside the packed dataset, saying what the states are and how to train.

Written by `pack` from the dataset's metadata, whose `trainers` key (see `trainers.trainer_settings`)
holds, per trainer, the settings that match the data: layer ids in that trainer's own convention, which
final state it gets (before or after the final norm), hidden size and dtype, or why it cannot use the
data. The card renders the same facts for people, with whether the states are stored lossy (fp8, and
the bound each value keeps) and what a receiver can check: the parity gate's verdict
(the states held against the checkpoint when they were made) and how to verify every byte after a copy;
docs/training.md has the full commands.
"""

from __future__ import annotations

from pathlib import Path

from eagle3data.storage.store import atomic_write_text

CARD_FILE = "README.md"


def _captures_table(metadata: dict) -> list[str]:
    lines = ["| slot | capture | meaning | vLLM aux id | transformers `hidden_states` index |",
             "| --- | --- | --- | --- | --- |"]
    for c in metadata["captures"]:
        hf = c["transformers_hidden_states_index"]
        lines.append(f"| {c['slot']} | `{c['name']}` | {c['meaning']} | {c['vllm_aux_layer_id']} | "
                     f"{'none (pre-norm final state)' if hf is None else hf} |")
    return lines


def _speculators(s: dict) -> list[str]:
    return [
        f"- `--target-layer-ids {' '.join(map(str, s['layer_ids']))}`; convention: {s['layer_id_convention']}.",
        f"- Final state: slot {s['final_state_source_slot']}, before the final norm, as speculators wants "
        "(its trainer applies the verifier's norm and lm_head).",
        f"- Hidden size {s['hidden_size']}; `--hidden-states-dtype {s['dtype']}` on GPU.",
        "- Export: `python -m eagle3data.exports.speculators` or config `export.speculators.enabled: true`.",
    ]


def _specforge(s: dict) -> list[str]:
    return [
        f"- `model.aux_hidden_state_layer_ids: {s['layer_ids']}`; convention: {s['layer_id_convention']}.",
        f"- Final state: after the final norm, computed by the export from slot {s['final_state_source_slot']} "
        "with the checkpoint's own final RMSNorm weight and eps.",
        f"- Hidden size {s['hidden_size']}; `model.torch_dtype: {s['dtype']}`.",
        "- Export: `python -m eagle3data.exports.specforge` or config `export.specforge.enabled: true`.",
    ]


def _lossy(metadata: dict) -> list[str]:
    """What lossy storage (`storage.compression.precision`) cost the states, or nothing for exact ones."""
    about = metadata.get("compression") or {}
    if not about.get("lossy"):
        return []
    bound = about["error_bound"]
    return ["", f"The states are stored lossy (`storage.compression.precision: {about['precision']}`): float8 e4m3 "
            f"codes with one float32 scale per token and capture. Each value reads back as {metadata['dtype']} "
            f"with an error of at most {bound['relative']:.4g} x its captured magnitude + "
            f"{bound['absolute_of_token_max']:.3g} x the largest magnitude of its token in that capture "
            "(`compression.error_bound` in the metadata); the captured values themselves are not kept."]


def _checks(parity: dict) -> list[str]:
    lines = ["## Checks", ""]
    if parity.get("status") == "off":
        lines.append("- Parity gate: off for this run (`parity.enabled: false`): the states were not held "
                     "against the checkpoint.")
    else:
        lines.append(f"- Parity gate: {parity['status']}, {parity['samples']} samples of {parity['shards']} "
                     "shards held against the checkpoint.")
        final, reference = parity.get("final_capture"), parity.get("reference")
        if final:
            lines.append(f"  The final capture through the final norm and head against the engine's next-token "
                         f"log-probabilities: worst median error {final['worst_median']}, worst single "
                         f"{final['worst_max']} (tolerances {final['tolerance']['median']}, "
                         f"{final['tolerance']['max']}).")
        if reference:
            lines.append(f"  {', '.join(f'`{c}`' for c in reference['captures'])} against transformers' float32 "
                         f"forward of the first {reference['layers']} layers: worst median relative error "
                         f"{reference['worst_median']} (tolerance {reference['tolerance']}).")
        lines += [f"  Not run: {why} ({n} shards)." for why, n in parity.get("not_run", {}).items()]
    lines.append("- Every row carries CRC-32s of its states and tokens; the readers verify them as they read. "
                 "After a copy, `python -m eagle3data.dataset.check --full DIR` verifies every byte.")
    return lines


def render_card(metadata: dict) -> str:
    model, counts = metadata["model"], metadata["counts"]
    lines = [
        f"# EAGLE-3 training data for `{model['path']}`",
        "",
        f"{counts['packed']} samples ({counts['conversations_in']} conversations in, {counts['skipped']} "
        f"skipped: {counts['skip_reasons']}). Target: {model['model_type']}, {model['num_hidden_layers']} "
        f"decoder layers, hidden size {metadata['hidden_size']}; states in {metadata['dtype']}, at most "
        f"{metadata['sequence']['max_seq_len']} tokens per sample. Written by eagle3-datagen; the full "
        "metadata is in `eagle3_metadata.json`. Open with `eagle3data.open_dataset`.",
        *_lossy(metadata),
        "",
        "## Hidden states (slot order; no final norm applied to any slot)",
        "",
        *_captures_table(metadata),
        "",
        *_checks(metadata.get("parity", {"status": "off"})),
        "",
        "## Matching trainer settings",
    ]
    for name, title, render in (("speculators", "speculators 0.9", _speculators),
                                ("specforge", "SpecForge", _specforge)):
        settings = metadata["trainers"][name]
        lines += ["", f"### {title}", ""]
        lines += render(settings) if settings["usable"] else [f"Not usable: {settings['reason']}"]
    lines += ["", "Both trainers take the draft vocabulary the pipeline writes beside this dataset "
              "(`token_freq.pt`, `vocab_mapping.pt`); see docs/training.md for the commands.", ""]
    return "\n".join(lines)


def write_card(directory: str | Path, metadata: dict) -> None:
    atomic_write_text(Path(directory) / CARD_FILE, render_card(metadata))
