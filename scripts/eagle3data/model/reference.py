"""transformers' float32 forward of a checkpoint's first decoder layers: the reference the parity gate
holds captured states against, independent of vLLM.

The model is built with its config cut after `layers` decoder layers, so only the weights of those
layers (and the embeddings, final norm and head) are read. The residual stream entering each decoder
layer, and the one reaching the final norm, are taken by hooks: stream s is the state after s decoder
layers, before any final norm (contracts/layers.py), whatever the architecture returns as its hidden
states.
"""

from __future__ import annotations

import torch


def _cut(config, layers: int) -> None:
    """`config` (the text model's) with its decoder cut after `layers` layers, per-layer lists too."""
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == config.num_hidden_layers and key.endswith("layer_types"):
            setattr(config, key, value[:layers])
    config.num_hidden_layers = layers


def load(model_dir: str, layers: int, trust_remote_code: bool = False):
    """The checkpoint's first `layers` decoder layers in float32 on the CPU, ready for `streams`."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    _cut(config.get_text_config(), layers)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the weights of the layers left out, listed one by one
    transformers.logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return model.eval()


def streams(model, token_ids: list[int]) -> dict[int, torch.Tensor]:
    """Stream index -> `[T, H]` float32 residual stream of one prompt: 0 .. the number of layers."""
    decoder = model.get_decoder()
    found: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(module, args, kwargs):
            found[index] = (args[0] if args else kwargs["hidden_states"])[0].detach()
        return hook

    hooks = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)]
    hooks.append(decoder.norm.register_forward_pre_hook(keep(len(decoder.layers)), with_kwargs=True))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return found
