"""Worker-side introspection, added to vLLM's workers with `worker_extension_cls`.

The driver asks every worker which hidden states its model will capture, so a speculative config that
the engine silently ignored or changed (wrong layer ids, wrong dtype) fails before any sample is
computed. Replies are small dicts of plain values: they cross two process hops (msgpack).
"""

from __future__ import annotations


class CaptureInfoExtension:
    def eagle3_capture_info(self) -> dict:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        model = self.model_runner.get_model()
        inner = getattr(model, "model", model)
        layers = getattr(inner, "aux_hidden_state_layers", None)
        return {
            "tp_rank": get_tensor_model_parallel_rank(),
            "aux_layer_ids": [int(i) for i in layers] if layers is not None else None,
            "dtype": str(self.model_runner.dtype).removeprefix("torch."),
        }
