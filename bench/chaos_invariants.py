"""The chaos bench's record of one run, read back through the coordinator's REST API, and the invariants it checks
against an undisturbed run of the same plan and the faults it injected (bench/chaos.py states the rules)."""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tests.integration.agent.system import System

FINAL = frozenset({"succeeded", "failed", "lost", "cancelled"})
ACTIVE = frozenset({"queued", "leased", "running"})
# Faults that may end an attempt (a lost or cancelled one), and the hosts whose attempts each can end.
COSTLY = frozenset({"agent-kill", "public-cut-long", "private-cut-long"})
SLACK_SECONDS = 0.5  # a claim this long after a fault ended still counts as during it (the clocks are one clock)
# The report's parts that are the experiment's science, not its timing: equal in every run of one plan. Not the
# selection's identity: it names each candidate's checkpoint receipt, whose journal holds the updates' wall times
# (the candidates' model identities are compared instead).
REPORT_SCIENCE = (
    "plan",
    "plan_identity",
    "prepared_identity",
    "arms",
    "candidates",
    "primary",
    "descriptive",
    "accuracy",
)
TRAINING_SCIENCE = ("ranks", "parameter_digest", "losses")
ANSWER_TIMING = ("seconds",)  # an answer's wall time: the only field of an answer that differs between runs


@dataclass(frozen=True)
class Fault:
    """One injected fault, as the invariants read it: ``rule`` is its kind with its duration's class (a cut is
    ``-long`` past the lease or collective timeout, ``-short`` well under it)."""

    index: int
    rule: str
    host: str | None  # None: the coordinator
    began: datetime.datetime
    ended: datetime.datetime
    hit: list[dict[str, Any]]  # the attempts active on the host when it began (and what they had done)


def at(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


def _all_pages(run: System, path: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after = None
    while True:
        separator = "&" if "?" in path else "?"
        page = run.server.get(f"{path}{separator}limit=1000" + (f"&after={after}" if after else ""))
        items += page["items"]
        after = page["next"]
        if after is None:
            return items


def collect(run: System) -> dict[str, Any]:
    """Everything the invariants read: the experiment's arms, jobs, every attempt (with its end, its resumed step
    and the steps the coordinator heard), its report, answers and serving results."""
    server, experiment = run.server, run.experiment["id"]
    hosts = {a["id"]: a["name"] for a in server.get("/api/agents")}
    jobs = server.jobs(experiment)
    attempts = []
    for job in jobs:
        for attempt in server.get(f"/api/jobs/{job['id']}/attempts"):
            events = _all_pages(run, f"/api/attempts/{attempt['id']}/events")
            ends = [e["at"] for e in events if e["kind"] == "state" and e["body"].get("to") in FINAL]
            started = [e["body"].get("resumed_from_step") for e in events if e["kind"] == "started"]
            attempts.append(
                {
                    "id": attempt["id"],
                    "job_id": job["id"],
                    "kind": job["kind"],
                    "arm": job["arm"],
                    "role": job["role"],
                    "spec": job["spec"],
                    "world_size": job["world_size"],
                    "number": attempt["number"],
                    "rank": attempt["rank"],
                    "host": hosts.get(attempt["agent_id"], "coordinator"),
                    "state": attempt["state"],
                    "reason": attempt["reason"],
                    "claimed_at": attempt["created_at"],
                    "ended_at": ends[0] if ends else None,
                    "resumed_from_step": started[0] if started else None,
                    "steps": [e["body"]["step"] for e in events if e["kind"] == "step"],
                    "step_seconds": [e["body"]["seconds"] for e in events if e["kind"] == "step"],
                }
            )
    response = server.http.get(f"/api/experiments/{experiment}/report")
    return {
        "experiment": experiment,
        "state": server.get(f"/api/experiments/{experiment}")["state"],
        "arms": server.get(f"/api/experiments/{experiment}/arms"),
        "jobs": jobs,
        "attempts": attempts,
        "report": response.json() if response.status_code == 200 else None,
        "answers": {
            role: _all_pages(run, f"/api/experiments/{experiment}/answers?role={role}") for role in ("test", "dev")
        },
        "serving": server.get(f"/api/experiments/{experiment}/serving-results"),
    }


def _check(name: str, problems: list[str], evidence: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "passed": not problems, "problems": problems[:20], "evidence": evidence}


def finished(record: dict[str, Any]) -> dict[str, Any]:
    problems = [] if record["state"] == "reported" else [f"the experiment ended {record['state']}, not reported"]
    problems += [f"job {j['kind']} {j['arm']} {j['role']} ended {j['state']}" for j in _unfinished(record)]
    return _check("finished", problems, {"state": record["state"], "jobs": len(record["jobs"])})


def _unfinished(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [job for job in record["jobs"] if job["state"] != "succeeded"]


def digests(truth: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Every arm's final parameter digest (and final step), and the report's per-rank digest and losses."""

    def arms(r: dict[str, Any]) -> dict[str, Any]:
        return {a["name"]: (a["model_identity"], a["final_step"]) for a in r["arms"]}

    def trained(r: dict[str, Any]) -> dict[str, Any]:
        training = (r["report"] or {}).get("training", {})
        return {arm: {k: entry.get(k) for k in TRAINING_SCIENCE} for arm, entry in training.items()}

    expected, found = arms(truth), arms(record)
    problems = [
        f"{arm}: {found.get(arm)} != undisturbed {want}" for arm, want in expected.items() if found.get(arm) != want
    ]
    problems += [
        f"report training {arm} differs" for arm, want in trained(truth).items() if trained(record).get(arm) != want
    ]
    return _check("digests", problems, {"arms": {arm: identity for arm, (identity, _) in found.items()}})


def _answers(record: dict[str, Any], role: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (item["arm"], item["answer"]["id"]): {k: v for k, v in item["answer"].items() if k not in ANSWER_TIMING}
        for item in record["answers"][role]
    }


def answers(truth: dict[str, Any], record: dict[str, Any], role: str) -> dict[str, Any]:
    """Every answer of ``role`` (test: the final test; dev: the dev evaluations), field by field but its time."""
    expected, found = _answers(truth, role), _answers(record, role)
    problems = []
    if set(expected) != set(found):
        problems.append(f"{len(found)} answers (undisturbed {len(expected)}); keys differ")
    for key in sorted(set(expected) & set(found)):
        fields = sorted(k for k in expected[key] if expected[key][k] != found[key].get(k))
        if fields:
            problems.append(f"{key[0]} task {key[1]}: {fields} differ")
    correct = sum(bool(a["check"]["correct"]) for a in found.values())
    return _check(f"{role}-answers", problems, {"answers": len(found), "correct": correct})


def report(truth: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """The verdict and the report's counts: every part of the report that is the science, not the timing."""
    want, got = truth["report"], record["report"]
    if got is None:
        return _check("report", ["no report"], {})
    problems = [f"report.{key} differs" for key in REPORT_SCIENCE if got.get(key) != want.get(key)]
    for key in ("reference", "agreement"):
        if (got.get("serving") or {}).get(key) != (want.get("serving") or {}).get(key):
            problems.append(f"report.serving.{key} differs")
    primary = got.get("primary") or {}
    verdict = primary.get("verdict") or {}
    evidence = {
        "passed": verdict.get("passed"),
        "conditions": {c["name"]: c.get("value") for c in verdict.get("conditions", [])},
        "paired": primary.get("paired"),
    }
    return _check("report", problems, evidence)


def served(record: dict[str, Any], workload: int) -> dict[str, Any]:
    """Every served answer is the dev evaluation of the served checkpoint (test_experiment's check)."""
    report_ = record["report"] or {}
    problems: list[str] = [] if report_ else ["no report"]
    serving = report_.get("serving") or {}
    selected = (report_.get("candidates") or {}).get("clean-pair")
    evaluated = {i["answer"]["id"]: i["answer"] for i in record["answers"]["dev"] if i["arm"] == "clean-pair"}
    phases = {}
    for result in record["serving"]:
        phase, completions = result["phase"], result["report"]["completions"]
        if result["report"]["models"] != [selected]:
            problems.append(f"{phase}: served {result['report']['models']}, not the selected {selected}")
        wrong = [
            c["task_id"] for c in completions if c["output_ids"] != evaluated.get(c["task_id"], {}).get("output_ids")
        ]
        if wrong:
            problems.append(f"{phase}: {len(wrong)} served answers differ from the dev evaluation: {wrong[:4]}")
        right = sum(bool(c["correct"]) for c in completions)
        if right != sum(
            bool(evaluated[c["task_id"]]["check"]["correct"]) for c in completions if c["task_id"] in evaluated
        ):
            problems.append(f"{phase}: {right} served answers correct, not the evaluation's count")
        phases[phase] = {"completions": len(completions), "correct": right}
    agreement = {phase: checked.get("identical") for phase, checked in (serving.get("agreement") or {}).items()}
    if agreement != dict.fromkeys(("single", "pair", "failure"), workload):
        problems.append(f"report agreement {agreement}, not {workload} identical per phase")
    return _check("served-answers", problems, {"phases": phases, "agreement": agreement})


def no_request_lost(record: dict[str, Any], workload: int) -> dict[str, Any]:
    """Each phase answered every request of its workload once, none failed; the failure phase lost none."""
    problems: list[str] = []
    phases = {}
    for result in record["serving"]:
        phase, body = result["phase"], result["report"]
        ids = [c["request_id"] for c in body["completions"]]
        if len(set(ids)) != len(ids) or len(ids) != workload:
            problems.append(f"{phase}: {len(set(ids))} distinct requests answered of {workload}")
        if body["failures"] or body["metrics"]["failed"]:
            problems.append(f"{phase}: failed requests {body['failures'][:3]}")
        retried = sum(1 for a in body["attempts"] if a["attempt"] > 1)
        phases[phase] = {"answered": len(set(ids)), "failed": body["metrics"]["failed"], "retries": retried}
    if sorted(phases) != ["failure", "pair", "single"]:
        problems.append(f"serving phases recorded: {sorted(phases)}")
    failure = ((record["report"] or {}).get("serving") or {}).get("failure") or {}
    if failure.get("lost") != 0:
        problems.append(f"the report's failure phase lost {failure.get('lost')}")
    return _check("no-request-lost", problems, {"phases": phases, "failure": failure})


def _gangs(record: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    gangs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for attempt in record["attempts"]:
        gangs[(attempt["job_id"], attempt["number"])].append(attempt)
    return gangs


def _cancelled_ok(attempt: dict[str, Any], gang: list[dict[str, Any]]) -> bool:
    """A rank cancelled with its lost peer, or a gang the coordinator requeued because it did not form."""
    reason = attempt["reason"] or ""
    return any(peer["state"] == "lost" for peer in gang) or "did not form" in reason


def accounted(record: dict[str, Any]) -> dict[str, Any]:
    """Every attempt ended succeeded or lost (cancelled only with a lost peer or an unformed gang), none failed,
    none left active; every job succeeded."""
    gangs = _gangs(record)
    problems = []
    states: dict[str, int] = defaultdict(int)
    for attempt in record["attempts"]:
        state = attempt["state"]
        states[state] += 1
        ok = state in ("succeeded", "lost") or (
            state == "cancelled" and _cancelled_ok(attempt, gangs[(attempt["job_id"], attempt["number"])])
        )
        if not ok:
            problems.append(f"{_name(attempt)} ended {state}: {(attempt['reason'] or '')[:300]}")
    problems += [f"job {j['kind']} {j['arm']} {j['role']} is {j['state']}" for j in _unfinished(record)]
    return _check("attempts-accounted", problems, {"attempts": len(record["attempts"]), "states": dict(states)})


def _name(attempt: dict[str, Any]) -> str:
    what = " ".join(
        str(x) for x in (attempt["kind"], attempt["arm"], attempt["role"], attempt["spec"].get("phase")) if x
    )
    return f"{what} #{attempt['number']} rank {attempt['rank']} on {attempt['host']}"


def _overlaps(attempts: list[dict[str, Any]], fault: Fault) -> bool:
    slack = datetime.timedelta(seconds=SLACK_SECONDS)
    for attempt in attempts:
        ended = at(attempt["ended_at"]) if attempt["ended_at"] else datetime.datetime.max.replace(tzinfo=datetime.UTC)
        if at(attempt["claimed_at"]) <= fault.ended + slack and ended >= fault.began:
            return True
    return False


def _could_end(fault: Fault, gang: list[dict[str, Any]]) -> bool:
    """Whether ``fault`` touched ``gang`` (one generation of a job: its ranks' attempts) while it ran."""
    if not _overlaps(gang, fault):
        return False
    if fault.rule == "coordinator-kill":
        return any(a["host"] == "coordinator" for a in gang)
    if fault.rule.startswith("private-cut"):
        return gang[0]["world_size"] > 1
    unformed = any("did not form" in (a["reason"] or "") for a in gang)
    return unformed or any(a["host"] == fault.host for a in gang)


def _costly(fault: Fault) -> bool:
    return fault.rule in COSTLY or fault.rule == "coordinator-kill"  # the latter: the coordinator's own attempts


def ended_by(record: dict[str, Any], faults: list[Fault]) -> dict[tuple[str, int], list[int]]:
    """Every generation that did not succeed -> the costly faults that could have ended it (by index)."""
    ended = {}
    for key, gang in _gangs(record).items():
        if any(a["state"] in ("lost", "cancelled", "failed") for a in gang):
            ended[key] = [f.index for f in faults if _costly(f) and _could_end(f, gang)]
    return ended


def losses_explained(record: dict[str, Any], faults: list[Fault]) -> dict[str, Any]:
    """Every generation that did not succeed was ended by an injected fault that may cost one; a loss that only a
    fault predicted free touched (a short cut, a slow link, a coordinator restart for an agent's attempt, a replica
    kill) is a violation too."""
    gangs = _gangs(record)
    problems = []
    explained = {}
    for key, causes in ended_by(record, faults).items():
        gang = gangs[key]
        name = _name(gang[0])
        if causes:
            explained[name] = causes
            continue
        free = [f.index for f in faults if not _costly(f) and _could_end(f, gang)]
        reasons = "; ".join(f"rank {a['rank']} {a['state']}: {(a['reason'] or '')[:200]}" for a in gang)
        what = f"only by free fault(s) {free}" if free else "by no injected fault"
        problems.append(f"{name} ended, touched {what} ({reasons})")
    return _check("losses-explained", problems, {"ended": explained})


def costly_faults_cost(record: dict[str, Any], faults: list[Fault], updates: int) -> dict[str, Any]:
    """A SIGKILLed host's attempts, and those active through a public cut past the lease, end without success
    (unless the result had been spooled before the fault); a pair with updates left through a private cut past the
    collective timeout ends without success."""
    by_id = {a["id"]: a for a in record["attempts"]}
    problems = []
    evidence = {}
    for fault in faults:
        if fault.rule not in COSTLY:
            continue
        outcomes = {}
        for hit in fault.hit:
            attempt = by_id.get(hit["attempt"])
            if attempt is None:
                continue
            outcomes[_name(attempt)] = attempt["state"]
            if fault.rule == "private-cut-long" and (hit.get("step") or 0) >= updates:
                continue  # its collectives were done
            if attempt["state"] == "succeeded" and not hit.get("result_spooled"):
                ended = at(attempt["ended_at"]) if attempt["ended_at"] else None
                if ended is None or ended > fault.began + datetime.timedelta(seconds=1):
                    problems.append(
                        f"fault {fault.index} ({fault.rule} on {fault.host}) hit {_name(attempt)}, which succeeded"
                    )
        evidence[str(fault.index)] = outcomes
    return _check("costly-faults-cost", problems, evidence)


def fault_costs(record: dict[str, Any], faults: list[Fault]) -> dict[str, Any]:
    """The report's faults of each trained arm are exactly the generations of its train job that did not succeed,
    each ended by an injected fault (losses_explained), one record per generation however many faults touched it;
    and each record's numbers are the coordinator's record of those attempts (experiment.report.attempts)."""
    report_ = record["report"] or {}
    problems = [] if report_ else ["no report"]
    evidence = {}
    ended = ended_by(record, faults)
    for arm, training in (report_.get("training") or {}).items():
        attempts = [a for a in record["attempts"] if a["kind"] == "train" and a["arm"] == arm]
        generations: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for attempt in attempts:
            generations[attempt["number"]].append(attempt)
        failed = sorted(n for n, gang in generations.items() if any(a["state"] != "succeeded" for a in gang))
        reported = training.get("faults") or []
        listed = [f["generation"] for f in reported]
        causes = {n: ended.get((generations[n][0]["job_id"], n), []) for n in failed}
        evidence[arm] = {"report": listed, "ended_generations": failed, "by_faults": causes}
        if listed != failed:
            problems.append(f"{arm}: the report lists generations {listed}, the attempts say {failed} did not succeed")
        for entry in reported:
            problems += _fault_entry(arm, entry, generations)
    return _check("fault-costs", problems, evidence)


def _fault_entry(arm: str, entry: dict[str, Any], generations: dict[int, list[dict[str, Any]]]) -> list[str]:
    """One report fault record against the attempts it counts: ended states, resumed step, updates recomputed
    (the steps heard past where the next started generation resumed), and seconds lost within the claims' span."""
    problems = []
    number = entry["generation"]
    gang = sorted(generations.get(number, []), key=lambda a: a["rank"])
    later = [n for n in sorted(generations) if n > number]
    if not gang or not later:
        return [f"{arm} generation {number}: the report counts a generation the attempts do not show"]
    if entry["ended"] != [a["state"] for a in gang]:
        problems.append(f"{arm} generation {number}: ended {entry['ended']}, attempts {[a['state'] for a in gang]}")
    started = [
        max(r)
        for n in later
        if (r := [a["resumed_from_step"] for a in generations[n] if a["resumed_from_step"] is not None])
    ]
    if started and entry["resumed_from_step"] != started[0]:
        problems.append(f"{arm} generation {number}: resumed_from_step {entry['resumed_from_step']} != {started[0]}")
    own = max((a["resumed_from_step"] or 0 for a in gang), default=0)
    reached = max((s for a in gang for s in a["steps"]), default=own)
    if entry["reached_step"] != reached:
        problems.append(f"{arm} generation {number}: reached_step {entry['reached_step']}, heard {reached}")
    if entry["updates_recomputed"] != max(0, reached - entry["resumed_from_step"]):
        problems.append(f"{arm} generation {number}: updates_recomputed {entry['updates_recomputed']}, heard {reached}")
    claimed = min(at(a["claimed_at"]) for a in gang)
    next_claimed = min(at(a["claimed_at"]) for a in generations[later[0]])
    span = (next_claimed - claimed).total_seconds()
    if not 0 < entry["seconds_lost"] <= span + 0.001:
        problems.append(f"{arm} generation {number}: seconds_lost {entry['seconds_lost']} not in (0, {span:.3f}]")
    return problems


def uploads_delivered(record: dict[str, Any], spools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every spooled upload was acknowledged, or refused because its attempt had ended without success."""
    states = {a["id"]: a["state"] for a in record["attempts"]}
    problems = []
    for host, spool in spools.items():
        for row in spool["not_acknowledged"]:
            ended = states.get(row["attempt"]) in ("lost", "cancelled")
            if not (row["state"] == "rejected" and "(attempt-already-ended)" in row["note"] and ended):
                attempt = next((a for a in record["attempts"] if a["id"] == row["attempt"]), None)
                name = _name(attempt) if attempt else row["attempt"]
                problems.append(f"{host}: {row['kind']} of {name} {row['state']}: {row['note']}")
    return _check("uploads-delivered", problems, {host: spool["states"] for host, spool in spools.items()})
