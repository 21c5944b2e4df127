"""The parity gate: every run holds a few samples of each shard against the checkpoint itself.

Contracts catch broken files; they cannot tell that a well-formed file holds the wrong states: a capture
one layer off, the final state taken after the final norm, states shifted against the token ids or
written under another request's id. Those are the capture bugs other pipelines shipped silently. So the
validate job of every shard checks `parity.samples_per_shard` samples its extract job computed:

- **final capture** (the last layer's output, before the final norm): through the checkpoint's final
  norm and output head in float32 (two tensors read by name: affordable for any model), it must give the
  log-probability of each next token that the engine itself gave as it captured the states (vLLM's prompt
  log-probabilities, returned with the states). That proves token alignment, the pre-norm convention
  and the last layer's identity on the user's model, TP and batching, with no second copy of the model.
- **reference**: transformers' float32 forward of the first decoder layers, up to the deepest capture
  whose layers fit `parity.reference_memory_gib` (every capture where the whole model fits), each
  capture compared token by token (median relative error). A failing capture is reported with the
  reference stream it is nearest to (a capture one layer off says so). Which layers the engine captures
  is a property of the run, and this reference costs a model of billions of parameters tens of CPU
  seconds beside the GPUs, so it runs in the first `parity.reference_shards` shards only.

The tolerances come from the bf16 floor measured on the demo and the real SmolLM2-135M (config/schema.yaml
says the numbers). A shard that fails raises: validate writes nothing, so nothing of it is packed, and the
screen names the check, the sample, the capture and the numbers. A check that cannot run (the samples were
all reused from an earlier job, so the engine returned no log-probabilities; no capture is the final
state; the model's final norm is not a plain RMSNorm; no capture fits the memory bound) is recorded with
its reason in the verdict, which goes to the validate log, the report and the dataset's metadata.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from eagle3data.contracts.failures import BoundaryError
from eagle3data.contracts.layers import Capture
from eagle3data.contracts.measuring import load_stored
from eagle3data.model import weights
from eagle3data.plan.shards import spread
from eagle3data.utils.defaults import Section
from eagle3data.utils.logs import get_logger

logger = get_logger(__name__)

GIB = 2**30
HEAD_ROWS = 16384  # vocabulary rows of the output head multiplied at a time (float32 copies stay small)
# Positions of a sample held against the engine's log-probabilities, spread over it: a shift, another
# request's states or a wrong layer shows at every position; the output head's cost (a matmul over the
# vocabulary per position, ~2.4 GFLOP on Kimi-K2.5) stays that of this many.
POSITIONS = 128


class ParityFailure(BoundaryError):
    pass


@dataclass(frozen=True)
class ParitySettings(Section):
    """The config's `parity` section, typed."""

    NAME = "parity"

    enabled: bool
    samples_per_shard: int
    max_log_prob_error: dict  # {"median": ..., "max": ...}
    max_state_error: float
    reference_shards: int
    reference_memory_gib: float


@dataclass
class ParityJob:
    shard: str
    model_path: str
    trust_remote_code: bool
    captures: list[Capture]
    num_hidden_layers: int
    settings: ParitySettings
    samples: list[tuple[str, str]]  # (sample id, states file) of the shard's validated samples
    log_probs: dict[str, list[float]]  # the engine's, per sample it returned them for


def gate(job: ParityJob) -> dict:
    """The verdict (JSON-ready); raises ParityFailure when a check fails."""
    began = time.perf_counter()
    chosen = _chosen(job)
    if not chosen:
        return {"shard": job.shard, "samples": [], "ok": True, "status": "not run", "why": "no validated samples"}
    witnesses = {sample_id: load_stored(path) for sample_id, path in chosen}
    verdict = {"shard": job.shard, "samples": [s for s, _ in chosen],
               "final_capture": _final_capture(job, witnesses), "reference": _reference(job, witnesses)}
    verdict["seconds"] = round(time.perf_counter() - began, 3)
    failures = [row for check in ("final_capture", "reference") for row in verdict[check].get("rows", [])
                if not row["ok"]]
    verdict["ok"] = not failures
    logger.info("parity verdict of shard %s: %s", job.shard, json.dumps(verdict))
    if failures:
        raise ParityFailure(_screen(job, failures))
    return verdict


def _chosen(job: ParityJob) -> list[tuple[str, str]]:
    """The samples the engine returned log-probabilities for, else samples spread over the shard."""
    witnessed = [(s, p) for s, p in job.samples if s in job.log_probs]
    return witnessed or spread(job.samples, job.settings.samples_per_shard)


def _final_capture(job: ParityJob, witnesses: dict[str, dict]) -> dict:
    final = [slot for slot, c in enumerate(job.captures) if c.stream_index == job.num_hidden_layers]
    if not final:
        return {"status": "not run", "why": "no capture is the last layer's output"}
    missing = [s for s in witnesses if s not in job.log_probs]
    if missing:
        return {"status": "not run", "why": "the engine returned no log-probabilities for these samples: "
                "their states were reused from an earlier extract job"}
    files = weights.tensor_files(job.model_path)
    try:
        norm = weights.read_final_norm(job.model_path, files)
    except weights.NotRMSNorm as exc:
        return {"status": "not run", "why": f"the final norm: {exc}"}
    head_name, head = weights.output_head(job.model_path, files)
    tolerance = job.settings.max_log_prob_error
    rows = []
    for sample_id, stored in witnesses.items():
        ids = stored["token_ids"].tolist()
        if len(ids) < 2:  # no next token to predict (min_seq_len 1)
            continue
        engine = torch.tensor(job.log_probs[sample_id], dtype=torch.float32)
        if len(engine) != len(ids) - 1:
            rows.append({"sample": sample_id, "ok": False, "capture": job.captures[final[0]].name,
                         "problem": f"the engine returned {len(engine)} log-probabilities for {len(ids)} tokens"})
            continue
        positions = torch.tensor(spread(range(len(ids) - 1), POSITIONS))
        ours = next_token_log_probs(stored["hidden_states"][positions, final[0]],
                                    [ids[i + 1] for i in positions.tolist()], norm, head)
        error = (ours - engine[positions]).abs()
        median, worst = float(error.median()), float(error.max())
        rows.append({"sample": sample_id, "capture": job.captures[final[0]].name, "tokens": len(ids),
                     "positions": len(positions), "median": round(median, 5), "max": round(worst, 5),
                     "max_at_token": int(positions[error.argmax()]) + 1,
                     "ok": median <= tolerance["median"] and worst <= tolerance["max"]})
    return {"status": "run", "tolerance": dict(tolerance), "norm": norm.source, "head": head_name, "rows": rows}


def next_token_log_probs(final: torch.Tensor, next_ids: list[int], norm: weights.FinalNorm,
                         head: torch.Tensor) -> torch.Tensor:
    """log p(next_ids[i] | the tokens before it), from the pre-norm final states `final [n, H]` of the
    positions before them, through the final norm and the output head, in float32."""
    x = norm(final.float())
    logits = torch.cat([x @ rows.float().T for rows in head.split(HEAD_ROWS)], dim=-1)
    return logits.log_softmax(-1).gather(1, torch.tensor(next_ids)[:, None])[:, 0]


def _reference(job: ParityJob, witnesses: dict[str, dict]) -> dict:
    if int(job.shard) >= job.settings.reference_shards:
        return {"status": "first shards only", "why": f"parity.reference_shards: {job.settings.reference_shards}"}
    layers, need, first = weights.reference_layers(job.model_path, [c.stream_index for c in job.captures],
                                                   job.settings.reference_memory_gib * GIB)
    if not layers:
        return {"status": "not run", "why": f"the first capture needs {first / GIB:.1f} GiB in float32, "
                f"parity.reference_memory_gib is {job.settings.reference_memory_gib}"}
    from eagle3data.model import reference

    loading = time.perf_counter()
    try:
        model = reference.load(job.model_path, layers, job.trust_remote_code)
    except Exception as exc:  # an architecture transformers cannot build: said, not hidden
        return {"status": "not run", "why": f"transformers could not build the model: {type(exc).__name__}: {exc}"}
    load_seconds = time.perf_counter() - loading
    checked = [(slot, c) for slot, c in enumerate(job.captures) if c.stream_index <= layers]
    rows = []
    for sample_id, stored in witnesses.items():
        expected = reference.streams(model, stored["token_ids"].tolist())
        for slot, capture in checked:
            found = stored["hidden_states"][:, slot].float()
            error = token_errors(found, expected[capture.stream_index])
            median = float(error.median())
            nearest = min(expected, key=lambda s: float(token_errors(found, expected[s]).median()))
            rows.append({"sample": sample_id, "capture": capture.name, "median": round(median, 5),
                         "nearest_stream": nearest, "ok": median <= job.settings.max_state_error})
    return {"status": "run", "layers": layers, "of": job.num_hidden_layers, "memory_gib": round(need / GIB, 3),
            "tolerance": job.settings.max_state_error, "load_seconds": round(load_seconds, 3), "rows": rows}


def token_errors(found: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|found - expected| / |expected| per token ([T, H] each, float32)."""
    return (found - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def _screen(job: ParityJob, failures: list[dict]) -> str:
    lines = [f"parity gate of shard {job.shard} failed: its states are not the checkpoint's ({job.model_path}) "
             "for these tokens; nothing from this shard is packed"]
    tolerance = job.settings.max_log_prob_error
    for row in failures:
        where = f"  sample {row['sample']}, capture {row['capture']}: "
        if "problem" in row:
            lines.append(where + row["problem"])
        elif "max_at_token" in row:
            lines.append(where + f"through the final norm and head, next-token log-probabilities differ from "
                         f"the engine's by a median {row['median']:.3g} (allowed {tolerance['median']}) and up "
                         f"to {row['max']:.3g} at token {row['max_at_token']} (allowed {tolerance['max']})")
        else:
            lines.append(where + f"differs from transformers' float32 forward by a median {row['median']:.3g} of "
                         f"its size per token (allowed {job.settings.max_state_error}); nearest reference: "
                         f"the stream after {row['nearest_stream']} decoder layers")
    lines.append("Causes: a capture at the wrong layer or after the final norm, states shifted against the "
                 "token ids, another request's states. What each check means: docs/output-format.md, "
                 "\"The parity gate\".")
    return "\n".join(lines)


def summarize(verdicts: list[dict]) -> dict:
    """The run's verdict over its shards' (the dataset's metadata, the report): what was checked, the
    worst numbers found, the checks not run and why."""
    if all(v.get("status") == "off" for v in verdicts):
        return {"status": "off"}
    summary: dict = {"status": "passed", "shards": len(verdicts), "samples": sum(len(v.get("samples", [])) for v in verdicts)}
    not_run: dict[str, int] = {}
    for check in ("final_capture", "reference"):
        ran = [v[check] for v in verdicts if v.get(check, {}).get("status") == "run"]
        for v in verdicts:
            if v.get(check, {}).get("status") == "not run":
                not_run[f"{check}: {v[check]['why']}"] = not_run.get(f"{check}: {v[check]['why']}", 0) + 1
        rows = [row for r in ran for row in r["rows"]]
        if rows:
            summary[check] = {"shards": len(ran), "tolerance": ran[0]["tolerance"],
                              "worst_median": max(row["median"] for row in rows)}
            if check == "final_capture":
                summary[check]["worst_max"] = max(row["max"] for row in rows)
            else:
                summary[check]["layers"] = min(r["layers"] for r in ran)
                summary[check]["captures"] = sorted({row["capture"] for row in rows})
    summary["not_run"] = not_run
    return summary
