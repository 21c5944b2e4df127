"""Which hidden states a capture means: the one place that defines layer semantics.

Tools disagree on whether "layer k" is the input or the output of decoder layer k, and whether the final
state is taken before or after the final norm. Here a capture names a decoder layer and a point:

- `input` of layer k: the residual stream entering decoder layer k = transformers `hidden_states[k]`
  = vLLM's EAGLE-3 auxiliary layer id k;
- `output` of layer k: the residual stream leaving it = transformers `hidden_states[k + 1]`, except for
  the last layer, whose output is taken BEFORE the final norm (transformers' `hidden_states[N]` is after
  it) = vLLM's aux id N.

Both reduce to a "stream index" s in [1, N]: the residual stream after s decoder layers, before any final
norm. That index is what vLLM's `eagle_aux_hidden_state_layer_ids` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Point = Literal["input", "output"]


@dataclass(frozen=True)
class Capture:
    """One captured tensor: the `point` (input or output) of decoder layer `layer`."""

    layer: int
    point: Point

    @property
    def name(self) -> str:
        return f"layer{self.layer}_{self.point}"

    @property
    def stream_index(self) -> int:
        """Residual stream after this many decoder layers (= vLLM aux layer id)."""
        return self.layer + (1 if self.point == "output" else 0)

    def hf_hidden_states_index(self, num_hidden_layers: int) -> int | None:
        """Index into transformers' `output_hidden_states`, or None for the pre-norm final state."""
        return self.stream_index if self.stream_index < num_hidden_layers else None

    def describe(self, num_hidden_layers: int) -> str:
        if self.stream_index == num_hidden_layers:
            return f"output of decoder layer {self.layer} (the last), before the final norm"
        where = "entering" if self.point == "input" else "leaving"
        return f"residual stream {where} decoder layer {self.layer}"


class CaptureConfigError(ValueError):
    pass


def eagle3_captures(num_hidden_layers: int) -> list[dict]:
    """EAGLE-3's usual captures for a model of N decoder layers, as speculators' and vLLM's defaults pick
    them: the streams entering layers 2, N // 2 and N - 3 (low, middle, high) and the last layer's
    output before the final norm (Kimi-K2.5, N = 61: 2, 30, 58 and 60's output)."""
    n = num_hidden_layers
    if n < 7:
        raise CaptureConfigError(
            f"captures: a model of {n} decoder layers has no EAGLE-3 default (layers 2, N//2 and N-3 "
            "must differ: N >= 7); list the captures in the config"
        )
    return [{"layer": layer, "point": "input"} for layer in (2, n // 2, n - 3)] + [
        {"layer": n - 1, "point": "output"}
    ]


def parse_captures(entries: list[dict], num_hidden_layers: int) -> list[Capture]:
    """Turn config entries into captures, refusing anything the engine cannot capture correctly."""
    captures = [Capture(int(e["layer"]), e["point"]) for e in entries]
    if not captures:
        raise CaptureConfigError("captures: at least one capture is needed")
    for c in captures:
        if not 0 <= c.layer < num_hidden_layers:
            raise CaptureConfigError(
                f"captures: layer {c.layer} does not exist; the model has decoder layers "
                f"0..{num_hidden_layers - 1}"
            )
        if c.stream_index == 0:
            raise CaptureConfigError(
                "captures: the input of layer 0 (the embeddings) cannot be captured with vLLM: its "
                "DeepSeek-V3 code has no residual there and crashes. Capture layer 1's input or later."
            )
    streams = [c.stream_index for c in captures]
    if len(set(streams)) != len(streams):
        raise CaptureConfigError(
            f"captures: two captures name the same hidden state (stream indices {streams}); "
            "the output of layer k is the input of layer k+1"
        )
    return captures


def vllm_aux_layer_ids(captures: list[Capture]) -> list[int]:
    return [c.stream_index for c in captures]


def capture_metadata(captures: list[Capture], num_hidden_layers: int) -> list[dict]:
    """The layer definitions written into dataset metadata, slot by slot."""
    return [
        {
            "slot": slot,
            "name": c.name,
            "decoder_layer": c.layer,
            "point": c.point,
            "meaning": c.describe(num_hidden_layers),
            "vllm_aux_layer_id": c.stream_index,
            "transformers_hidden_states_index": c.hf_hidden_states_index(num_hidden_layers),
            "final_norm_applied": False,
        }
        for slot, c in enumerate(captures)
    ]
