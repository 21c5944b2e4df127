"""A small DeepSeek-V3 (Kimi's MLA sizes and yarn rope, 16 heads, 8 experts) with saved random weights,
plus the demo tokenizer: the GPU comparison with transformers and the TP1-vs-TP2 run use it.

    python scripts/gpu/build_small_deepseek.py OUT_DIR TOKENIZER_DIR [--dense]   (--dense: no MoE layer)
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM

from eagle3data.model.demo import tiny_deepseek_v3_config
from eagle3data.model.shapes import TOKENIZER_FILES


def main(out: Path, tokenizer_dir: Path, dense: bool) -> None:
    config = tiny_deepseek_v3_config(vocab_size=2048, num_hidden_layers=8, hidden_size=1024)
    if dense:
        config.first_k_dense_replace = config.num_hidden_layers
    config.num_attention_heads = config.num_key_value_heads = 16  # divisible by TP 2
    config.q_lora_rank = 512
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # as the demo model: wider than the 0.02 init so that layers differ visibly
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, 0.04)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, out / f)
    print(out, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), "--dense" in sys.argv[3:])
