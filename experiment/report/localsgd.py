"""The local-SGD design's verdict (docs/local-sgd.md): DiLoCo's test accuracy against its matched DDP control's by
the plan's exact non-inferiority test, DiLoCo's retention bound against the seed, and the bytes each rank wrote
against the ring all-reduce's theory for each synchronization."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import msgspec

from experiment.core.plan import Plan
from experiment.learning import stats
from experiment.learning.records import Answer
from experiment.learning.stats import Condition, Retention, Verdict


class NonInferiority(msgspec.Struct, frozen=True):
    """``arm`` against ``control`` on the test items: wins are items the arm answers right and its control wrong.
    H0: the arm's accuracy is lower by ``margin`` or more; exact unconditional test (stats.noninferiority_p_value)."""

    arm: str
    control: str
    n: int
    wins: int
    losses: int
    difference: float  # (wins - losses) / n: the arm's accuracy less its control's
    margin: float
    p_value: float
    max_p_value: float
    non_inferior: bool


class Communication(msgspec.Struct, frozen=True):
    """What one arm's ranks wrote while they updated (their journals' written_bytes), against the theory: each
    synchronization is a ring all-reduce of every float32 parameter, 2 (N-1)/N x 4 B x parameters per rank."""

    ranks: int
    synchronizations: int  # every update (the control), or every sync_every updates (DiLoCo)
    theory_bytes_per_rank: float
    written_bytes: list[int] | None  # per rank; None when a journal lacks the count
    written_bytes_per_update: list[float] | None
    written_over_theory: list[float] | None


class LocalSgd(msgspec.Struct, frozen=True):
    noninferiority: NonInferiority
    retention: dict[str, Retention]  # each trained arm against the seed
    communication: dict[str, Communication]
    diloco_over_control_bytes: float | None  # the ranks' mean written bytes, DiLoCo's over its control's
    diloco_over_control_median_update: float
    verdict: Verdict


def _communication(plan: Plan, arm: str, written: list[int] | None) -> Communication:
    ranks, updates = plan.world_size(arm), plan.training.updates
    synchronizations = updates // (plan.arm_plan(arm).sync_every or 1)
    theory = synchronizations * 2 * (ranks - 1) / ranks * 4 * plan.seed.parameters
    return Communication(
        ranks=ranks,
        synchronizations=synchronizations,
        theory_bytes_per_rank=theory,
        written_bytes=written,
        written_bytes_per_update=None if written is None else [sent / updates for sent in written],
        written_over_theory=None if written is None else [sent / theory for sent in written],
    )


def section(
    plan: Plan,
    answers: Mapping[str, list[Answer]],
    losses: Mapping[str, Mapping[str, float]],
    written: Mapping[str, list[int] | None],
    median_update_seconds: Mapping[str, float],
) -> LocalSgd:
    """The criteria of a local-SGD plan, from its checked test answers, retention losses and training runs."""
    assert plan.noninferiority is not None  # the plan's rule for its design
    seed, control, diloco = plan.arm("baseline"), plan.arm("control"), plan.arm("diloco")
    wins, losses_ = stats.paired_counts(
        {a.id: a.check.correct for a in answers[control]}, {a.id: a.check.correct for a in answers[diloco]}
    )
    n, margin, largest = len(answers[control]), plan.noninferiority.margin, plan.noninferiority.max_p_value
    p_value = stats.noninferiority_p_value(wins, losses_, n, margin)
    test = NonInferiority(
        arm=diloco,
        control=control,
        n=n,
        wins=wins,
        losses=losses_,
        difference=(wins - losses_) / n,
        margin=margin,
        p_value=p_value,
        max_p_value=largest,
        non_inferior=p_value <= largest,
    )
    z = plan.statistics.retention_z
    retention = {arm: stats.retention_bound(losses[seed], losses[arm], z) for arm in plan.trained_arms()}
    communication = {arm: _communication(plan, arm, written[arm]) for arm in plan.trained_arms()}
    control_sent, diloco_sent = communication[control].written_bytes, communication[diloco].written_bytes
    bound = plan.statistics.max_retention_upper_nats
    conditions = [
        Condition(
            name="non-inferiority p_value <= max_p_value", value=p_value, threshold=largest, passed=p_value <= largest
        ),
        Condition(
            name=f"{diloco} retention upper bound <= max_retention_upper_nats",
            value=retention[diloco].upper,
            threshold=bound,
            passed=retention[diloco].upper <= bound,
        ),
    ]
    return LocalSgd(
        noninferiority=test,
        retention=retention,
        communication=communication,
        diloco_over_control_bytes=None
        if control_sent is None or diloco_sent is None
        else statistics.fmean(diloco_sent) / statistics.fmean(control_sent),
        diloco_over_control_median_update=median_update_seconds[diloco] / median_update_seconds[control],
        verdict=Verdict(passed=all(c.passed for c in conditions), conditions=conditions),
    )
