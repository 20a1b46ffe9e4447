"""The report, recomputed from an evidence bundle. Every check that fails stops it, names the file and
the field, and writes nothing. The coordinator runs the same code online."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2
import msgspec

from experiment.core import layout, tasks
from experiment.core.canonical import canonical_bytes, sha256_file, write_new_bytes
from experiment.core.errors import CoopError
from experiment.core.layout import ATTEMPTS, LEDGER, MANIFEST, PREPARED, SEED, SELECTION, SERVING
from experiment.core.ledger import read_ledger
from experiment.core.members import member, refuse_links
from experiment.core.plan import Plan
from experiment.learning import stats
from experiment.learning.answers import evaluation_dir, read_answers
from experiment.learning.corpus import Document, Prepared, TaskItem, is_damaged, load_prepared, prompt_ids
from experiment.learning.records import Answer, Candidate, RetentionScore, StepRecord, Summary
from experiment.learning.records import Result as RunResult
from experiment.learning.schedule import schedule
from experiment.learning.selection import Selection, read_selection, same_model, selection_identity
from experiment.report import figures, localsgd, servingcheck
from experiment.report.attempts import arm_faults, read_attempts
from experiment.report.model import (
    Accuracy,
    ArmTraining,
    Comparison,
    Descriptive,
    Margin,
    Primary,
    Report,
    Serving,
)
from experiment.seed.seedtokenizer import SeedTokenizer, read_tokenizer
from experiment.serving.servingrecord import PHASES


def _require(condition: bool, where: Path | str, field: str, problem: str) -> None:
    if not condition:
        raise CoopError(f"{where}: {field}: {problem}")


class _TokenizerConfig(msgspec.Struct):
    """What of the seed's tokenizer_config.json names other files: transformers opens each, relative to the folder."""

    fast_tokenizer_files: list[str] = msgspec.field(default_factory=list)


def _seed_tokenizer(bundle: Path, prepared: Prepared) -> SeedTokenizer:
    """The seed's tokenizer files in the bundle, each checked against the plan's recorded hash."""
    folder = bundle / SEED
    _require(folder.is_dir(), folder, "seed", "the bundle has no seed tokenizer files")
    for path in sorted(folder.iterdir()):
        recorded = prepared.plan.seed.files.get(path.name)
        _require(recorded is not None, path, "seed.files", "this file is not in the plan's seed snapshot")
        _require(sha256_file(path) == recorded, path, "sha256", "differs from the plan's seed snapshot")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            named = msgspec.json.decode(config.read_bytes(), type=_TokenizerConfig).fast_tokenizer_files
        except msgspec.DecodeError as exc:
            raise CoopError(f"{config}: fast_tokenizer_files: is not a list of file names: {exc}") from exc
        for name in named:
            member(bundle, SEED, name, f"{SEED}/{config.name} fast_tokenizer_files")
    return read_tokenizer(folder)


def _check_items(prepared: Prepared, tokenizer: SeedTokenizer, role: tasks.Role, items: list[TaskItem]) -> None:
    """Regenerate every case from the plan's task seed and compare id, prompt, answer and prompt tokens."""
    where = prepared.home / "prepared" / prepared.manifest.roles[role].file
    _require(len(items) == getattr(prepared.plan.tasks, role), where, "count", "differs from the plan")
    for position, item in enumerate(items):
        case = tasks.make_case(prepared.plan.tasks.task_seed, role, position)
        prompt = tasks.render_prompt(case)
        label = f"line {position + 1}"
        _require(item.index == position, where, f"{label}.index", f"is {item.index}, expected {position}")
        _require(item.id == tasks.task_id(case), where, f"{label}.id", "is not the regenerated task's id")
        _require(item.prompt == prompt, where, f"{label}.prompt", "is not the regenerated prompt")
        _require(item.expected == tasks.expected_answer(case), where, f"{label}.expected", "is not the oracle's")
        _require(
            (item.family, item.variant) == (case.family, case.variant),
            where,
            f"{label}.family",
            "family or variant differs",
        )
        _require(item.input_dependent == tasks.is_input_dependent(case), where, f"{label}.input_dependent", "differs")
        _require(
            item.prompt_ids == prompt_ids(tokenizer, prompt),
            where,
            f"{label}.prompt_ids",
            "differ from the seed tokenizer's rendering",
        )
    _require(
        [i.id for i in items] == prepared.manifest.ids[role],
        prepared.home / PREPARED / MANIFEST,
        f"ids.{role}",
        "differ from the role file",
    )


def _check_training_inputs(prepared: Prepared, clean: list[Document], damaged: list[Document]) -> None:
    manifest_path = prepared.home / PREPARED / MANIFEST
    plan = prepared.plan
    train_ids = [tasks.task_id(tasks.make_case(plan.tasks.task_seed, "train", i)) for i in range(plan.tasks.train)]
    _require(
        [d.id for d in clean] == prepared.manifest.ids["train"],
        manifest_path,
        "ids.train",
        "differ from train-clean",
    )
    _require(
        [d.id for d in clean[: plan.tasks.train]] == train_ids,
        manifest_path,
        "ids.train",
        "grounded ids are not the regenerated train tasks",
    )
    _require(
        [d.id for d in damaged] == [d.id for d in clean],
        manifest_path,
        "ids.train",
        "the damaged copy has other ids or another order",
    )
    expected_damaged = [i for i in train_ids if is_damaged(i)]
    _require(
        prepared.manifest.damaged_ids == expected_damaged,
        manifest_path,
        "damaged_ids",
        "are not the ids with int(id, 16) % 4 == 0",
    )
    _require(
        [d.id for d in damaged if d.damaged] == expected_damaged,
        manifest_path,
        "damaged_ids",
        "differ from the damaged documents' marks",
    )
    for clean_doc, damaged_doc in zip(clean, damaged, strict=True):
        if not damaged_doc.damaged:
            _require(
                clean_doc == damaged_doc,
                manifest_path,
                f"train document {clean_doc.id}",
                "an undamaged document differs between the copies",
            )


def _check_journal(
    path: Path, journal: list[StepRecord], plan: Plan, rank: int, world: int, docs: list[Document]
) -> None:
    batches = schedule(plan)
    for record in journal:
        batch = batches[record.step - 1] if 0 < record.step <= len(batches) else []
        where = f"journal[{record.step}]"
        _require(record.positions == batch, path, f"{where}.positions", "are not the schedule's")
        _require(
            record.local_positions == batch[rank::world], path, f"{where}.local_positions", "are not this rank's share"
        )
        _require(
            record.weighted_targets == sum(docs[p].targets * docs[p].weight for p in batch),
            path,
            f"{where}.weighted_targets",
            "differ from the prepared documents",
        )
    steps = [r.step for r in journal]
    _require(steps == list(range(1, plan.training.updates + 1)), path, "journal", "steps are not 1..updates")


def _check_rank(run: Path, prepared: Prepared, selected: Candidate, world: int, docs: list[Document]) -> RunResult:
    """One rank's result: its folder, inputs, journal (the schedule's) and final digest (the selected one)."""
    plan = prepared.plan
    path = run / "result.json"
    _require(path.is_file(), path, "result", "is missing")
    try:
        result = msgspec.json.decode(path.read_bytes(), type=RunResult)
    except msgspec.DecodeError as exc:
        raise CoopError(f"{path}: result: is not a training result: {exc}") from exc
    _require(
        run.name == f"rank-{result.rank}" and result.world_size == world,
        path,
        "rank",
        "does not match its folder or the arm's world",
    )
    _require(result.prepared_identity == prepared.identity, path, "prepared_identity", "is not the bundle's")
    _require(len(result.journal) == plan.training.updates, path, "journal", "does not hold every update")
    _check_journal(path, result.journal, plan, result.rank, world, docs)
    _require(result.parameter_digest == selected.model_identity, path, "parameter_digest", "is not the selected one")
    _require(result.binding == selected.binding, path, "binding", "is not the selected candidate's")
    _require(result.candidate.step == plan.training.updates, path, "candidate.step", "is not the final update")
    return result


def _check_runs(
    prepared: Prepared, selection: Selection, documents: dict[str, list[Document]], bundle: Path
) -> dict[str, ArmTraining]:
    """Every rank's journal is the schedule; ranks agree; the final digests are the selected candidates; the
    coordinator's record of the attempts (when the bundle has one) ends in the ranks' own results."""
    plan = prepared.plan
    attempts = read_attempts(bundle)
    summary: dict[str, ArmTraining] = {}
    for arm in plan.trained_arms():
        folder = prepared.home / layout.arm_runs(arm)
        runs = sorted(folder.glob("rank-*"))
        world = plan.world_size(arm)
        _require(len(runs) == world, folder, "ranks", f"{len(runs)} result folders, expected {world}")
        docs = documents[plan.training_documents(arm)]
        results = [_check_rank(run, prepared, selection.arms[arm], world, docs) for run in runs]
        first = results[0]
        update_seconds = [r.seconds for r in first.journal]
        resumed = [r.resumed_from_step for r in results]
        interface = first.communication.get("interface") if world > 1 else None
        summary[arm] = ArmTraining(
            ranks=len(results),
            parameter_digest=first.parameter_digest,
            loop_seconds=[round(r.loop_seconds, 3) for r in results],
            median_update_seconds=statistics.median(update_seconds),
            update_seconds=update_seconds,
            losses=[r.loss for r in first.journal],
            network_bytes_sent=[r.network_end.bytes_sent - r.network_start.bytes_sent for r in results],
            network_scope=first.network_start.scope,
            peak_memory_bytes=[r.peak_memory_bytes for r in results],
            peak_memory_kind=first.peak_memory_kind,
            numerical_profile=first.numerical_profile,
            private_interface=interface,
            private_bytes_per_update=None
            if interface is None
            else [_private_per_update(run, result, interface, plan) for run, result in zip(runs, results, strict=True)],
            allreduce_bytes_per_update=None
            if interface is None
            else 2 * (world - 1) / world * 4 * plan.seed.parameters,
            faults=None
            if attempts is None
            else arm_faults(bundle / ATTEMPTS, arm, attempts, resumed, plan.training.updates, _require),
            written_bytes=_written(results),
        )
    return summary


def _written(results: list[RunResult]) -> list[int]:
    """Per rank, what its process wrote during its updates, every update of its journal counted."""
    return [sum(record.written_bytes for record in result.journal) for result in results]


def _private_per_update(run: Path, result: RunResult, interface: str, plan: Plan) -> float:
    """Bytes the rank sent on its private interface per update of its run (a resumed run made fewer)."""
    start, end = result.network_start.interfaces.get(interface), result.network_end.interfaces.get(interface)
    _require(start is not None and end is not None, run / "result.json", "network_end", f"has no {interface}")
    assert start is not None and end is not None
    return (end["bytes_sent"] - start["bytes_sent"]) / (plan.training.updates - result.resumed_from_step)


def _check_answers(
    path: Path,
    summary: Summary,
    answers: list[Answer],
    items: list[TaskItem],
    tokenizer: SeedTokenizer,
    max_new_tokens: int,
) -> None:
    eos_id = tokenizer.eos_id
    _require([a.id for a in answers] == [i.id for i in items], path, "id", "answers are not the role's tasks in order")
    for number, (answer, item) in enumerate(zip(answers, items, strict=True), start=1):
        where = f"line {number}"
        _require(answer.prompt_ids == item.prompt_ids, path, f"{where}.prompt_ids", "are not the prepared prompt's")
        _require(
            (answer.index, answer.family, answer.variant, answer.input_dependent)
            == (item.index, item.family, item.variant, item.input_dependent),
            path,
            f"{where}.index",
            "index, family, variant or input_dependent differ from the prepared task",
        )
        ids = answer.output_ids
        _require(len(ids) <= max_new_tokens, path, f"{where}.output_ids", "exceed the plan's max_new_tokens")
        ends = bool(ids) and ids[-1] == eos_id and eos_id not in ids[:-1]
        _require(answer.ended_with_eos == ends, path, f"{where}.ended_with_eos", "contradicts the output ids")
        _require(
            answer.hit_token_limit == (not ends and len(ids) == max_new_tokens),
            path,
            f"{where}.hit_token_limit",
            "contradicts the output ids",
        )
        text = tokenizer.decode(ids[:-1] if ends else ids)
        _require(text == answer.text, path, f"{where}.text", "is not the seed tokenizer's decoding of output_ids")
        _require(
            tasks.check(answer.text, item.expected) == answer.check,
            path,
            f"{where}.check",
            "is not the strict checker's outcome",
        )
    _require(
        summary.correct == sum(a.check.correct for a in answers) and summary.answers == len(answers),
        path.parent / "evaluation.json",
        "correct",
        "differs from the answers",
    )


def _evaluation(
    prepared: Prepared, selection: Selection, tokenizer: SeedTokenizer, items: list[TaskItem], role: str, arm: str
) -> tuple[list[Answer], list[RetentionScore]]:
    """One evaluation of the bundle, every file and answer checked: for these inputs, of the selected candidate
    (a test evaluation also under this selection), every answer re-decoded and re-checked."""
    folder = evaluation_dir(prepared.home, role, arm)
    _require((folder / "evaluation.json").is_file(), folder, "evaluation.json", f"the {role} evaluation is missing")
    summary, answers, scores = read_answers(folder)
    where = folder / "evaluation.json"
    _require(summary.arm == arm and summary.role == role, where, "arm", "is not this folder's arm and role")
    _require(summary.prepared_identity == prepared.identity, where, "prepared_identity", "differs")
    if role == "test":
        chosen = selection_identity(selection)
        _require(summary.selection_identity == chosen, where, "selection_identity", "is not the bundle's selection")
    _require(same_model(summary.candidate, selection.arms[arm]), where, "candidate", "is not the selected candidate")
    _require(
        summary.max_new_tokens == prepared.plan.evaluation.max_new_tokens,
        where,
        "max_new_tokens",
        "differs from the plan",
    )
    _require(summary.numerics == prepared.plan.evaluation.numerics, where, "numerics", "differs from the plan")
    max_new_tokens = prepared.plan.evaluation.max_new_tokens
    _check_answers(folder / "answers.jsonl", summary, answers, items, tokenizer, max_new_tokens)
    retention_ids = prepared.manifest.ids["retention"]
    _require([s.id for s in scores] == retention_ids, folder / "retention.jsonl", "id", "are not the retention probes")
    _require(all(math.isfinite(s.mean_nats) for s in scores), folder / "retention.jsonl", "mean_nats", "is not finite")
    return answers, scores


def _check_ledger(bundle: Path, expected: dict[str, str]) -> int | None:
    """When the bundle carries the coordinator's ledger: the chain verifies, and its commitments name
    these inputs (plan, prepared, selection). Returns the number of entries."""
    path = bundle / LEDGER
    if not path.exists():
        return None
    entries = read_ledger(path)
    for entry in entries:
        if entry.kind in expected:
            _require(
                entry.identity == expected[entry.kind],
                path,
                f"seq {entry.seq}.identity",
                f"the {entry.kind} commitment is not this bundle's {entry.kind} identity",
            )
    return len(entries)


def _accuracy(answers: list[Answer]) -> Accuracy:
    correct: Callable[[Answer], bool] = lambda a: a.check.correct  # noqa: E731
    dependent = [a for a in answers if a.input_dependent]
    return Accuracy(
        overall=stats.cell([a.check.correct for a in answers]),
        by_family=stats.breakdown(answers, key=lambda a: a.family, correct=correct),
        by_variant=stats.breakdown(answers, key=lambda a: f"wording {a.variant}", correct=correct),
        input_dependent=stats.cell([a.check.correct for a in dependent]),
        valid_json_object=sum(a.check.valid_json_object for a in answers),
        hit_token_limit=sum(a.hit_token_limit for a in answers),
    )


@dataclass(frozen=True)
class _Checked:
    """What the checks of a bundle established, before any comparison."""

    prepared: Prepared
    selection: Selection
    ledger_entries: int | None
    training: dict[str, ArmTraining]
    serving: Serving | None
    evaluations: dict[str, tuple[list[Answer], list[RetentionScore]]]


def _check_bundle(bundle: Path) -> _Checked:
    """Every check of the bundle's files; raises CoopError at the first inconsistency."""
    refuse_links(bundle)  # the bundle came from elsewhere: nothing in it may point outside it
    prepared = load_prepared(bundle)
    plan = prepared.plan
    tokenizer = _seed_tokenizer(bundle, prepared)
    dev, test = prepared.task_items("dev"), prepared.task_items("test")
    _check_items(prepared, tokenizer, "dev", dev)
    _check_items(prepared, tokenizer, "test", test)
    documents = {"train-clean": prepared.documents("train-clean"), "train-damaged": prepared.documents("train-damaged")}
    _check_training_inputs(prepared, documents["train-clean"], documents["train-damaged"])
    selection_path = bundle / SELECTION
    _require(selection_path.is_file(), selection_path, "selection", "is missing")
    selection = read_selection(selection_path)
    _require(selection.prepared_identity == prepared.identity, selection_path, "prepared_identity", "differs")
    _require(set(selection.arms) == set(plan.arm_names()), selection_path, "arms", "must name every arm")
    committed = {"plan": prepared.manifest.plan_identity, "prepared": prepared.identity}
    ledger_entries = _check_ledger(bundle, committed | {"selection": selection_identity(selection)})
    return _Checked(
        prepared=prepared,
        selection=selection,
        ledger_entries=ledger_entries,
        serving=_serving(bundle, prepared, selection, tokenizer, dev),
        training=_check_runs(prepared, selection, documents, bundle),
        evaluations={arm: _evaluation(prepared, selection, tokenizer, test, "test", arm) for arm in plan.arm_names()},
    )


def _serving(
    bundle: Path, prepared: Prepared, selection: Selection, tokenizer: SeedTokenizer, dev: list[TaskItem]
) -> Serving | None:
    """The serving section when the bundle was served; served answers are checked against the dev evaluation of
    the served checkpoint, itself checked first."""
    ledger_path = bundle / LEDGER
    served = ledger_path.exists() and any(e.kind == "serving" for e in read_ledger(ledger_path))
    if not served and not (bundle / SERVING).is_dir():
        return None
    arm = prepared.plan.served_arm()
    reference, _ = _evaluation(prepared, selection, tokenizer, dev, "dev", arm)
    identity = selection.arms[arm].model_identity
    return servingcheck.section(bundle, prepared, identity, reference, dev, tokenizer, _require)


def _descriptive(plan: Plan, checked: _Checked, accuracy: dict[str, Accuracy]) -> Descriptive:
    outcomes = {arm: {a.id: a.check.correct for a in answers} for arm, (answers, _) in checked.evaluations.items()}
    losses = {arm: {s.id: s.mean_nats for s in scores} for arm, (_, scores) in checked.evaluations.items()}
    seed, clean, damaged, pair = (plan.arm(role) for role in ("baseline", "clean", "damaged", "pair"))
    pairs = [(seed, damaged), (damaged, clean), (seed, pair), (clean, pair)]
    margin = plan.statistics.pair_margin
    return Descriptive(
        comparisons=[Comparison(baseline=b, arm=a, paired=stats.paired(outcomes[b], outcomes[a])) for b, a in pairs],
        pair_margin=Margin(
            arm=pair,
            baseline=clean,
            margin=margin,
            within=stats.within_margin(accuracy[pair].overall, accuracy[clean].overall, margin),
        ),
        retention={
            arm: stats.retention_bound(losses[seed], losses[arm], plan.statistics.retention_z)
            for arm in plan.trained_arms()
        },
    )


def _primary(plan: Plan, checked: _Checked) -> Primary:
    seed, clean = plan.arm("baseline"), plan.arm("clean")
    (seed_answers, seed_scores), (clean_answers, clean_scores) = checked.evaluations[seed], checked.evaluations[clean]
    paired = stats.paired({a.id: a.check.correct for a in seed_answers}, {a.id: a.check.correct for a in clean_answers})
    retention = stats.retention_bound(
        {s.id: s.mean_nats for s in seed_scores}, {s.id: s.mean_nats for s in clean_scores}, plan.statistics.retention_z
    )
    return Primary(
        comparison=f"{clean} vs {seed}, exact test items",
        baseline=seed,
        arm=clean,
        paired=paired,
        retention=retention,
        verdict=stats.primary_verdict(paired, retention, plan.statistics),
    )


CHECKS = [
    "seed tokenizer files match the plan",
    "dev and test tasks regenerated from the plan's seed",
    "damaged ids recomputed",
    "every rank's journal equals the schedule",
    "ranks agree on final digests",
    "candidates equal the selection",
    "every answer re-checked and re-decoded",
]
SERVING_CHECK = (
    "serving: selected model only, answers equal the served model's dev evaluation, none degenerate, "
    "no cache hits, none lost, same tokens in every phase, stop seen"
)


def _local_sgd(plan: Plan, checked: _Checked) -> localsgd.LocalSgd:
    evaluations, training = checked.evaluations, checked.training
    return localsgd.section(
        plan,
        {arm: answers for arm, (answers, _) in evaluations.items()},
        {arm: {s.id: s.mean_nats for s in scores} for arm, (_, scores) in evaluations.items()},
        {arm: row.written_bytes for arm, row in training.items()},
        {arm: row.median_update_seconds for arm, row in training.items()},
    )


def compute(bundle: Path) -> Report:
    """Every check, then every comparison of the plan's design; raises CoopError at the first inconsistency."""
    checked = _check_bundle(bundle)
    prepared, selection = checked.prepared, checked.selection
    plan = prepared.plan
    accuracy = {arm: _accuracy(answers) for arm, (answers, _) in checked.evaluations.items()}
    reference = plan.design() == "reference"
    single, pair = (plan.arm("clean"), plan.arm("pair")) if reference else ("", "")
    return Report(
        plan=plan.name,
        plan_identity=prepared.manifest.plan_identity,
        prepared_identity=prepared.identity,
        selection_identity=selection_identity(selection),
        arms=list(plan.arm_names()),
        candidates={arm: c.model_identity for arm, c in selection.arms.items()},
        ledger_entries=checked.ledger_entries,
        primary=_primary(plan, checked) if reference else None,
        descriptive=_descriptive(plan, checked, accuracy) if reference else None,
        accuracy=accuracy,
        training=checked.training,
        pair_over_single_median_update=checked.training[pair].median_update_seconds
        / checked.training[single].median_update_seconds
        if reference
        else None,
        serving=checked.serving,
        checks=[*CHECKS, *([SERVING_CHECK] if checked.serving else [])],
        design=plan.design(),
        local_sgd=None if reference else _local_sgd(plan, checked),
    )


def render_html(report: Report) -> str:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("experiment.report", "templates"), autoescape=True, undefined=jinja2.StrictUndefined
    )
    return environment.get_template("report.html").render(
        report=report, figures=figures.report_figures(report), phases=PHASES
    )


def write_report(bundle: Path, output: Path) -> Report:
    """Compute (all checks first), then write the JSON report and the HTML page beside it."""
    report = compute(bundle)
    html = render_html(report)
    write_new_bytes(output, canonical_bytes(msgspec.to_builtins(report)) + b"\n")
    write_new_bytes(output.with_suffix(".html"), html.encode("utf-8"))
    return report
