"""What each EAGLE-3 trainer reads, in its own layer convention, and which of the dataset's slots match.

The dataset defines a capture by its stream index s (see `contracts/layers.py`: the residual stream after s decoder
layers, before any final norm). The trainers name the same states differently:

- speculators 0.9 (`--target-layer-ids`) uses vLLM's aux ids: id = s. Its 4th tensor is the verifier's
  last hidden state BEFORE the final norm (stream N); the trainer applies the verifier's norm itself.
- SpecForge (`model.aux_hidden_state_layer_ids`) uses SGLang's ids: id k = the output of decoder layer k,
  so id = s - 1 (SGLang adds 1 internally). It wants exactly three aux states, ids 0..N-2, and the final
  state AFTER the final norm, which the export computes from stream N (see `final_norm.py`).

Renaming ids is exact, and so is computing the post-norm state from the pre-norm one. Anything else is
not, and `layout` refuses it, saying what the trainer wants and what the dataset holds: a layer the
dataset did not capture (e.g. outputs of layers whose inputs were captured one layer off), or no
pre-norm final state (none at all, or one stored after the norm: a norm cannot be undone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class ExportRefused(ValueError):
    """The dataset cannot be converted exactly into what a trainer expects."""


@dataclass(frozen=True)
class Trainer:
    name: str
    id_offset: int  # trainer layer id = stream index - id_offset
    final_state: Literal["pre_norm", "post_norm"]
    aux_count: int | None  # the number of aux states the trainer accepts, None for any
    layer_ids_setting: str  # where a user puts the ids in the trainer's own configuration

    def convention(self, num_hidden_layers: int) -> str:
        if self.id_offset == 0:
            return (f"id k = residual stream entering decoder layer k, vLLM's aux numbering, "
                    f"{num_hidden_layers} = final")
        return "id k = output of decoder layer k, SGLang's numbering"

    def id_range(self, num_hidden_layers: int) -> range:
        """Layer ids the trainer can ask for: speculators 0..N, SpecForge (SGLang) 0..N-2."""
        return range(0, num_hidden_layers + 1 - 2 * self.id_offset)


SPECULATORS = Trainer("speculators", 0, "pre_norm", None, "--target-layer-ids")
SPECFORGE = Trainer("specforge", 1, "post_norm", 3, "model.aux_hidden_state_layer_ids")
TRAINERS = {t.name: t for t in (SPECULATORS, SPECFORGE)}


@dataclass(frozen=True)
class Layout:
    """Dataset slots for one trainer: aux slots in the trainer's order, then the final state's slot."""

    trainer: Trainer
    layer_ids: list[int]
    aux_slots: list[int]
    final_slot: int


def _held(captures: list[dict]) -> str:
    return ", ".join(f"{c['name']} (vLLM aux id {c['vllm_aux_layer_id']})" for c in captures)


def _default_ids(trainer: Trainer, captures: list[dict], final: dict) -> list[int]:
    return [c["vllm_aux_layer_id"] - trainer.id_offset for c in captures if c is not final]


def layout(trainer: Trainer, metadata: dict, layer_ids: list[int] | None = None) -> Layout:
    """Map the dataset's captures onto `trainer`; `layer_ids` (trainer convention) default to every
    capture before the final state, in slot order. Raises ExportRefused where that is not exact."""
    captures, n = metadata["captures"], metadata["model"]["num_hidden_layers"]
    by_stream = {c["vllm_aux_layer_id"]: c for c in captures}
    final = by_stream.get(n)
    if final is None:
        raise ExportRefused(
            f"{trainer.name}: needs the verifier's final hidden state (output of decoder layer {n - 1}, vLLM "
            f"aux id {n}); the dataset holds only {_held(captures)}. Re-extract with "
            f"{{layer: {n - 1}, point: output}} in captures."
        )
    if final.get("final_norm_applied", False):
        raise ExportRefused(
            f"{trainer.name}: expected the final state before the final norm, as the pipeline stores it; slot "
            f"{final['slot']} ({final['name']}) holds it after the norm, which cannot be undone exactly (and "
            "normed again would be normed twice)"
        )
    if layer_ids is None:
        layer_ids = _default_ids(trainer, captures, final)
    if trainer.aux_count is not None and len(layer_ids) != trainer.aux_count:
        raise ExportRefused(
            f"{trainer.name}: expected exactly {trainer.aux_count} aux layer ids, found {len(layer_ids)} "
            f"({layer_ids})"
        )
    if not layer_ids or len(set(layer_ids)) != len(layer_ids):
        raise ExportRefused(f"{trainer.name}: expected one or more distinct aux layer ids, found {layer_ids}")
    aux_slots = []
    for layer_id in layer_ids:
        if layer_id not in trainer.id_range(n):
            raise ExportRefused(
                f"{trainer.name}: layer id {layer_id} is outside the ids it can use with {n} decoder layers: "
                f"{trainer.id_range(n).start}..{trainer.id_range(n).stop - 1} ({trainer.convention(n)})"
            )
        capture = by_stream.get(layer_id + trainer.id_offset)
        if capture is None:
            raise ExportRefused(
                f"{trainer.name}: layer id {layer_id} ({trainer.convention(n)}) is vLLM aux id "
                f"{layer_id + trainer.id_offset}, which the dataset did not capture; it holds "
                f"{_held(captures)}. Use ids {_default_ids(trainer, captures, final)} for this data, "
                "or re-extract."
            )
        aux_slots.append(capture["slot"])
    return Layout(trainer, list(layer_ids), aux_slots, final["slot"])


def trainer_settings(metadata: dict) -> dict:
    """Per trainer, the settings that match the data (for the dataset card), or why none do."""
    settings = {}
    for trainer in TRAINERS.values():
        try:
            lay = layout(trainer, metadata)
        except ExportRefused as exc:
            settings[trainer.name] = {"usable": False, "reason": str(exc)}
            continue
        settings[trainer.name] = {
            "usable": True,
            "layer_ids": lay.layer_ids,
            "layer_ids_setting": trainer.layer_ids_setting,
            "layer_id_convention": trainer.convention(metadata["model"]["num_hidden_layers"]),
            "aux_slots": lay.aux_slots,
            "final_state": trainer.final_state,
            "final_state_source_slot": lay.final_slot,
            "hidden_size": metadata["hidden_size"],
            "dtype": metadata["dtype"],
        }
    return settings
