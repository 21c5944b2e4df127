"""How far transformers in bf16 is from itself in fp32, per capture, and for MoE layers how many tokens
pick other experts: how far any bf16 engine's states can be from an fp32 reference by rounding alone.

    python scripts/gpu/bf16_floor.py MODEL_DIR [MODEL_DIR ...]   (the small DeepSeek-V3s of build_small_deepseek.py)

Runs on CPU. It explains the MoE model's disagreement with transformers on the GPU (docs/troubleshooting.md).
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from eagle3bench.crosscheck import compare, reference_states
from eagle3data.contracts.layers import parse_captures
from eagle3bench.synthetic import random_prompts

CAPTURES = [{"layer": 2, "point": "input"}, {"layer": 4, "point": "input"}, {"layer": 6, "point": "input"},
            {"layer": 7, "point": "output"}]  # as scripts/gpu/run.sh's crosschecks


def expert_choices(model) -> dict[int, torch.Tensor]:
    """Each MoE layer's chosen experts per token of the model's last forward pass (sorted), kept up to
    date by hooks on the routers."""
    chosen = {}
    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hook = lambda mod, inp, out, index=index: chosen.__setitem__(index, out[2].sort(dim=-1).values)
            layer.mlp.gate.register_forward_hook(hook)
    return chosen


def main(model_dir: str) -> None:
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    captures = parse_captures(CAPTURES, fp32.config.num_hidden_layers)
    chosen32, chosen16 = expert_choices(fp32), expert_choices(bf16)
    worst, flipped = {}, {}
    for sample_id, ids in random_prompts(6, 256, fp32.config.vocab_size, seed=1, vary=True).items():
        want, got = reference_states(fp32, ids, captures), reference_states(bf16, ids, captures)
        for row in compare(sample_id, got, want, captures):
            worst[row["capture"]] = max(worst.get(row["capture"], 0.0), row["rel_error"])
        for index in chosen32:
            share = (chosen32[index] != chosen16[index]).any(dim=-1).float().mean().item()
            flipped.setdefault(index, []).append(share)
    print(model_dir, "worst relative error, bf16 vs fp32:", {k: round(v, 4) for k, v in worst.items()})
    if flipped:
        print("  share of tokens routed to other experts, per MoE layer:",
              {index: round(sum(v) / len(v), 3) for index, v in sorted(flipped.items())})


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        main(directory)
