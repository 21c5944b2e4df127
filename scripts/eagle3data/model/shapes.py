"""Full-size model shapes as config.json only, for GPU runs with random weights (`load_format: dummy`).

vLLM builds random weights on the GPU from config.json alone, so a Kimi-K2.5-shaped or an 8B-class
model can be run without writing tens of GB of weights. The demo tokenizer can be copied beside the
config so that the pipeline's tokenize stage works too (its ids are valid in any larger vocabulary).

    python -m eagle3data.model.shapes kimi-k2.5 DIR [--tokenizer-from resources/demo-model]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from eagle3data.model.demo import kimi_like_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def kimi_k25_config(n_routed_experts: int = 8, num_experts_per_tok: int = 2, num_hidden_layers: int = 61):
    """Kimi-K2.5's language model (DeepSeek-V3 architecture) with fewer routed experts (384 in the real one)."""
    return kimi_like_config(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        q_lora_rank=1536,
        rms_norm_eps=1e-5,
        dtype="bfloat16",
        architectures=["DeepseekV3ForCausalLM"],  # without it vLLM 0.26 serves the model as a pooler
    )


def _llama_config(**shape):
    """A Llama-architecture config of `shape` (sizes, rope), bf16, as vLLM serves it."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape, rms_norm_eps=1e-5, dtype="bfloat16", architectures=["LlamaForCausalLM"])


def llama_8b_config():
    """Llama-3.1-8B's shape (8.03e9 parameters)."""
    return _llama_config(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


def smollm2_135m_config():
    """SmolLM2-135M-Instruct's shape: a small model's states come at more bytes a second per GPU than an
    8B model's (~4.6 KB a token, at several times the tokens a second), the store's hardest case."""
    return _llama_config(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


SHAPES = {"kimi-k2.5": kimi_k25_config, "llama-8b": llama_8b_config, "smollm2-135m": smollm2_135m_config}


def write_shape(name: str, out_dir: Path, tokenizer_from: Path | None = None) -> Path:
    """Write config.json of shape `name` (and the tokenizer files of `tokenizer_from`) to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    SHAPES[name]().save_pretrained(out_dir)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (tokenizer_from / f).is_file():
                shutil.copy2(tokenizer_from / f, out_dir / f)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, help="copy this model directory's tokenizer files")
    args = parser.parse_args()
    print(write_shape(args.shape, args.out_dir, args.tokenizer_from))


if __name__ == "__main__":
    main()
