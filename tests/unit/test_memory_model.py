"""The GPU memory model (experiment.learning.memory) against every peak the H200 check measured, and the margins it
leaves on the reference plan's L40S: for a single rank, a rank of the pair, and beside a replica."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from experiment.core.errors import CoopError
from experiment.core.plan import load_plan
from experiment.learning import decoding, evaluation, memory, preflight
from experiment.serving.replica import ReplicaSpec
from tests.support import ROOT

REFERENCE = ROOT / "plans" / "reference.toml"
MEASURED = ROOT / "bench" / "results" / "gpu-check-h200.json"
TOLERANCE = 0.05
PROFILE_FIGURES = ("held_before", "forward_backward_above_held", "held_before_step", "optimizer_step_above_held")


def _measured() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(MEASURED.read_text())
    return found


def _close(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def test_the_reference_shape_counts_the_reference_seeds_parameters() -> None:
    assert memory.SMOLLM2_1_7B.parameters == load_plan(REFERENCE).seed.parameters == memory.CALIBRATION_PARAMETERS


def test_the_model_reproduces_the_h200_training_peaks_within_five_percent() -> None:
    """The real step, 8 documents of 1,024 tokens an update: alone, and under DDP in a group of one, which holds
    what a rank of the pair holds in torch's allocator (NCCL's buffers are outside it)."""
    measured = _measured()
    plan = load_plan(REFERENCE)
    assert measured["plan"] == plan.name and measured["training_step"]["document_tokens"] == 1024
    single = memory.training_rank(plan, 1).allocated
    pair = memory.training_rank(plan, 2).allocated
    group_of_one = memory.update(plan.seed.parameters, [1024] * 8, ddp=True, first=False).peak
    assert _close(single, measured["training_step"]["peak_memory_bytes"])
    assert _close(pair, measured["ddp_group_of_one"]["peak_memory_bytes"])
    assert _close(group_of_one, measured["ddp_group_of_one"]["peak_memory_bytes"])


@pytest.mark.parametrize("run", ["one_document", "two_documents", "two_documents_ddp"])
def test_the_model_reproduces_each_profiled_update_within_five_percent(run: str) -> None:
    """Held before each update, its forwards' and backwards' peak, held before its step and the step's peak: the
    first update makes AdamW's moments (12 B a parameter above held), later ones only its temporary (4 B)."""
    profile = _measured()["memory_profile"]
    parameters = profile["parameters"]
    for measured in profile[run]:
        predicted = memory.update(
            parameters, measured["document_tokens"], ddp=run.endswith("_ddp"), first=measured["update"] == 1
        )
        for figure in PROFILE_FIGURES:
            assert _close(getattr(predicted, figure), measured[f"{figure}_bytes"]), (run, measured["update"], figure)
        peaks = (
            measured["held_before_bytes"] + measured["forward_backward_above_held_bytes"],
            measured["held_before_step_bytes"] + measured["optimizer_step_above_held_bytes"],
        )
        assert _close(predicted.peak, max(peaks))


def test_the_gradients_set_the_peak_not_the_activations() -> None:
    plan = load_plan(REFERENCE)
    peak = memory.training_rank(plan, 2)
    per_parameter = sum(peak.term(name) for name in ("weights", "adam moments", "ddp buckets", "gradients"))
    assert per_parameter + peak.term("later document's gradient") == 24 * plan.seed.parameters
    assert peak.term("activations") < 0.02 * peak.allocated


def test_the_l40s_margins_of_a_single_rank_and_a_pair_rank() -> None:
    """Of an L40S's 48.31 GB, the model's whole peak (the CUDA context and NCCL's buffers included, both estimates)
    leaves 12.85 GB to a single rank and 5.47 GB to a rank of the pair, before the allocator's reserve beyond what it
    hands out (1.65 GB and 0.81 GB measured on the H200). The preflight, which also asks the plan's 4 GiB of headroom,
    leaves 8.56 GB and 1.18 GB of the memory free once the context exists."""
    plan = load_plan(REFERENCE)
    margins = []
    for world_size in (1, plan.training.pair_world_size):
        peak = memory.training_rank(plan, world_size)
        free_with_context = memory.L40S_BYTES - peak.term("cuda context")
        margins.append((memory.L40S_BYTES - peak.total, free_with_context - preflight.memory_needed(plan, world_size)))
    assert [(round(model / 1e9, 2), round(rule / 1e9, 2)) for model, rule in margins] == [(12.85, 8.56), (5.47, 1.18)]
    assert all(model > 0 and rule > 0 for model, rule in margins)


def test_a_host_holding_a_replica_has_room_for_no_training_and_no_evaluation() -> None:
    """vLLM takes 0.9 of the card (43.48 GB of an L40S) and leaves 4.83 GB: less than the bf16 evaluation's
    estimated 9.52 GB, and far less than a training rank. So no GPU job may run on a host whose GPU a replica holds."""
    plan = load_plan(REFERENCE)
    utilization = ReplicaSpec(model_dir=Path("seed"), served_model_name="seed", port=1).gpu_memory_utilization
    left = memory.L40S_BYTES - memory.replica(memory.L40S_BYTES, utilization).total
    answering = memory.evaluation(plan, memory.SMOLLM2_1_7B, evaluation.CUDA_BATCH_SIZE, decoding.PREFILL_ROWS)
    assert round(left / 1e9, 2) == 4.83 and round(answering.total / 1e9, 2) == 9.52
    assert left < answering.total < memory.training_rank(plan, 1).total


def test_the_preflight_refusal_names_each_term(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = load_plan(REFERENCE)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * 2**30, memory.L40S_BYTES))
    with pytest.raises(CoopError) as refused:
        preflight.check_memory(plan, 2, torch.device("cuda", 0))
    message = str(refused.value)
    assert "needs 43.3 GiB" in message
    for name in (
        "weights",
        "adam moments",
        "ddp buckets",
        "activations",
        "nccl buffers 0.54 GB (estimate)",
        "4 GiB headroom",
    ):
        assert name in message
    preflight.check_memory(plan, 1, torch.device("cuda", 0))  # a single rank's 36.4 GiB fits in 40
