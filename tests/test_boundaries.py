"""Replies that cross vLLM's process boundaries are checked where they arrive.

The bug this project was born from: an extra `[0]` on an RPC reply turned four `[T, H]` tensors into
T tensors of `[H]`, and nothing crashed. Here a real engine answers, and the same `[0]` on its replies
must fail loudly, naming what was expected and what was found.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import with_defaults

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from eagle3data.engine import start as engine
    from eagle3data.capture.extract import check_reply
    from eagle3data.contracts.layers import parse_captures

    def outcome(fn):
        try:
            fn()
            return "ok"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    if __name__ == "__main__":
        a = json.loads(sys.argv[1])
        captures = parse_captures(a["captures"], 8)
        llm = engine.start_engine(engine.engine_kwargs(a["model"], captures, "bfloat16", 64,
                                                       engine.EngineSettings.from_config(a["engine"]),
                                                       False, a["store"]), 1)
        replies = llm.collective_rpc("eagle3_capture_info")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        path = a["store"] + "/one.safetensors"
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": path}}))
        kv = out[0].kv_transfer_params
        print(json.dumps({
            "replies_ok": outcome(lambda: engine.check_worker_replies(replies, 1, captures, "bfloat16")),
            "replies_indexed": outcome(lambda: engine.check_worker_replies(replies[0], 1, captures, "bfloat16")),
            "other_layers": outcome(lambda: engine.check_worker_replies(replies, 1, captures[:3], "bfloat16")),
            "kv_ok": outcome(lambda: check_reply("s1", kv, path)),
            "kv_wrapped": outcome(lambda: check_reply("s1", [kv], path)),
        }))
    """
)


def test_indexing_a_reply_once_too_often_fails_loudly(tiny_deepseek, tmp_path):
    captures = [{"layer": 2, "point": "input"}, {"layer": 4, "point": "input"},
                {"layer": 5, "point": "input"}, {"layer": 7, "point": "output"}]
    config = with_defaults({"input": "x.jsonl", "model": {"path": str(tiny_deepseek)}, "captures": captures,
                            "engine": {"device": "cpu"}})
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    args = {"model": str(tiny_deepseek), "captures": captures, "engine": config["engine"],
            "store": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    result = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    assert result["replies_ok"] == "ok"
    assert "expected a list of 1 replies (one per worker), found dict" in result["replies_indexed"]
    assert "captures layers [2, 4, 5, 8]" in result["other_layers"] and "expected [2, 4, 5]" in result["other_layers"]
    assert result["kv_ok"] == "ok"
    assert "expected a dict with 'hidden_states_path', found list" in result["kv_wrapped"]
    assert "sample s1" in result["kv_wrapped"]
