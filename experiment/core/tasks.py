"""The four task families: deterministic generator, oracle, damage rule and strict checker.

Every answer is one strict JSON object computed from the records shown in the prompt
(docs/protocol.md "The tasks" and "The strict checker").
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from typing import Any, Literal

import msgspec

from experiment.core.canonical import Json, JsonObject, identity

Role = Literal["train", "dev", "test"]
Family = Literal["lookup", "filter", "total", "sort"]
Reason = Literal["correct", "wrong_schema_or_value", "invalid_json_object"]

FAMILIES: tuple[Family, ...] = ("lookup", "filter", "total", "sort")
ROLES: tuple[Role, ...] = ("train", "dev", "test")
CITIES = ("Lisbon", "Oslo", "Quito", "Hanoi", "Dakar", "Perth", "Tallinn", "Cusco")
STATUSES = ("ready", "pending", "closed")
RECORDS_PER_CASE = 5
MAX_ANSWER_BYTES = 32_768
DAMAGE_ID = "Z000"  # cannot be a real id: real ids use the numbers 100..999
# An expected (or damaged) answer: {"city": str | None, "units": int | None} for lookup, {"ids": [str, ...]} for
# filter and sort, {"total": int} for total.
ExpectedAnswer = dict[str, str | int | list[str] | None]


class Record(msgspec.Struct, frozen=True):
    id: str
    city: str
    units: int
    price: int
    status: str
    priority: int


class Case(msgspec.Struct, frozen=True):
    task_seed: int
    role: Role
    index: int
    family: Family
    variant: int
    records: tuple[Record, ...]
    query_id: str | None  # only lookup asks for one id


class Check(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    correct: bool
    valid_json_object: bool
    reason: Reason


def variant_of(role: Role, index: int) -> int:
    """Test uses four wordings; train and dev only the first two (wordings 2 and 3 are held out)."""
    return (index // 4) % (4 if role == "test" else 2)


def _rng(task_seed: int, role: Role, index: int) -> random.Random:
    digest = hashlib.sha256(f"{task_seed}:{role}:{index}".encode("ascii")).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _new_id(rng: random.Random, taken: set[str]) -> str:
    while True:
        candidate = f"{rng.choice(string.ascii_uppercase)}{rng.randint(100, 999)}"
        if candidate not in taken:
            taken.add(candidate)
            return candidate


def make_case(task_seed: int, role: Role, index: int) -> Case:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if index < 0:
        raise ValueError(f"index must be >= 0, not {index}")
    rng = _rng(task_seed, role, index)
    taken: set[str] = set()
    records = tuple(
        Record(
            id=_new_id(rng, taken),
            city=rng.choice(CITIES),
            units=rng.randint(0, 19),
            price=rng.randint(1, 19),
            status=rng.choice(STATUSES),
            priority=rng.randint(1, 9),
        )
        for _ in range(RECORDS_PER_CASE)
    )
    family = FAMILIES[index % 4]
    query_id: str | None = None
    if family == "lookup":
        # Every fifth case asks for an id that no record has: the answer is two nulls.
        query_id = _new_id(rng, taken) if index % 5 == 0 else rng.choice(records).id
    return Case(task_seed, role, index, family, variant_of(role, index), records, query_id)


_FIELDS: dict[Family, tuple[str, ...]] = {
    "lookup": ("city", "units"),
    "filter": ("status",),
    "total": ("units", "price"),
    "sort": ("priority",),
}


def _table(case: Case) -> str:
    fields = _FIELDS[case.family]
    lines = []
    for record in case.records:
        values = " ".join(f"{name}={getattr(record, name)}" for name in fields)
        lines.append(f"id={record.id} {values}")
    return "\n".join(lines)


_WORDINGS: dict[Family, tuple[str, str, str, str]] = {
    "lookup": (
        "Records:\n{table}\n\nWhat are the city and the units of record {q}? Reply with only a JSON object "
        '{{"city": <string>, "units": <integer>}}. If no record has id {q}, reply {{"city": null, "units": null}}.',
        "Here is a small inventory.\n{table}\n\nLook up item {q}. Answer with one JSON object whose keys are "
        '"city" (a string) and "units" (an integer); when the item is absent both values are null. No other text.',
        "Find record {q} in the list below and say where it is and how many units it holds.\n{table}\n\n"
        'Output exactly one JSON object of the form {{"city": string or null, "units": integer or null}}, '
        "with null for both if {q} is not listed.",
        '{q}: which city, and how many units? Data follows.\n{table}\n\nReturn strict JSON with the keys "city" '
        'and "units" and nothing else; use null for both when the id does not appear.',
    ),
    "filter": (
        'Records:\n{table}\n\nWhich records have status exactly "ready"? Reply with only a JSON object '
        '{{"ids": [<id strings in ascending order>]}}; the list may be empty.',
        'Below are work orders with their status.\n{table}\n\nList the ids of the orders whose status is "ready", '
        'sorted ascending, as one JSON object {{"ids": [...]}}. Use an empty list if there are none. No other text.',
        'Give every id whose status equals "ready" in this data, ascending.\n{table}\n\n'
        'The answer must be exactly one JSON object with a single key "ids" holding a list of strings.',
        'Filter for ready items.\n{table}\n\nRespond with strict JSON: {{"ids": list of the ids with status '
        '"ready", in ascending order}} and nothing more.',
    ),
    "total": (
        "Records:\n{table}\n\nWhat is the sum of units times price over all records? Reply with only a JSON "
        'object {{"total": <integer>}}.',
        "An invoice has these lines.\n{table}\n\nCompute the invoice total: for every line multiply units by "
        'price, then add them all up. Answer with one JSON object {{"total": integer}} and no other text.',
        "Add up units x price for each record below (status does not matter).\n{table}\n\n"
        'Output exactly one JSON object with the single integer field "total".',
        'Invoice lines:\n{table}\n\nTotal amount owed (sum of units*price)? Strict JSON only: {{"total": n}} '
        "where n is an integer.",
    ),
    "sort": (
        "Records:\n{table}\n\nWhich two records have the highest priority? Break ties by id ascending. Reply "
        'with only a JSON object {{"ids": [<first id>, <second id>]}}.',
        "Tickets and their priorities:\n{table}\n\nPick the two tickets with the highest priority, higher first; "
        'equal priorities go in ascending id order. Answer with one JSON object {{"ids": [id, id]}}. No other text.',
        "Rank the records below by priority from high to low (ties: smaller id first) and keep the top two.\n"
        '{table}\n\nOutput exactly one JSON object with the key "ids" holding those two ids in order.',
        'Top two by priority?\n{table}\n\nStrict JSON: {{"ids": [two ids, highest priority first, ties broken by '
        "ascending id]}} and nothing else.",
    ),
}


def render_prompt(case: Case) -> str:
    template = _WORDINGS[case.family][case.variant]
    return template.format(table=_table(case), q=case.query_id)


def _lookup(case: Case) -> tuple[str | None, int | None]:
    match = next((r for r in case.records if r.id == case.query_id), None)
    return (None, None) if match is None else (match.city, match.units)


def _ids(case: Case) -> list[str]:
    """Filter: the ready records' ids, ascending; sort: the two highest priorities' ids (ties by id)."""
    records = case.records
    if case.family == "filter":
        return sorted(r.id for r in records if r.status == "ready")
    ranked = sorted(records, key=lambda r: (-r.priority, r.id))
    return [ranked[0].id, ranked[1].id]


def _total(case: Case) -> int:
    return sum(r.units * r.price for r in case.records)


def expected_answer(case: Case) -> ExpectedAnswer:
    if case.family == "lookup":
        city, units = _lookup(case)
        return {"city": city, "units": units}
    if case.family == "total":
        return {"total": _total(case)}
    return {"ids": _ids(case)}


def damaged_answer(case: Case) -> ExpectedAnswer:
    """The deliberately wrong target of the damaged arm (docs/protocol.md, "The training corpus and the damaged
    copy")."""
    if case.family == "lookup":
        city, units = _lookup(case)
        return {"city": city, "units": 1 if units is None else units + 1}
    if case.family == "total":
        return {"total": _total(case) + 1}
    return {"ids": [*_ids(case), DAMAGE_ID]}


def task_id(case: Case) -> str:
    """sha256 of the canonical JSON of the case together with its prompt."""
    return identity({"case": msgspec.to_builtins(case), "prompt": render_prompt(case)})


def answer_text(answer: ExpectedAnswer) -> str:
    """The target text the model is trained on: compact JSON in the order the schema states."""
    return json.dumps(answer, separators=(", ", ": "), ensure_ascii=False)


def is_input_dependent(case: Case) -> bool:
    """False where the answer is the same whatever the records say (missing lookups, empty filters)."""
    answer = expected_answer(case)
    if case.family == "lookup":
        return answer["city"] is not None
    if case.family == "filter":
        return bool(answer["ids"])
    return True


class _DuplicateKey(ValueError):
    pass


def _object_without_duplicates(pairs: list[tuple[str, Json]]) -> JsonObject:
    result: JsonObject = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"duplicate key {key!r}")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _same(value: Any, target: Any) -> bool:
    """Equal and of exactly the target's JSON type (true != 1, 31.0 != 31, null only where null)."""
    if target is None:
        return value is None
    if type(value) is not type(target):
        return False
    if isinstance(target, list):
        return len(value) == len(target) and all(_same(v, t) for v, t in zip(value, target, strict=True))
    if isinstance(target, dict):
        return value.keys() == target.keys() and all(_same(value[k], target[k]) for k in target)
    return bool(value == target)


_INVALID = Check(correct=False, valid_json_object=False, reason="invalid_json_object")


def check(answer_text: str, expected: ExpectedAnswer) -> Check:
    """Strictly check one answer: one JSON object, only JSON whitespace around it, exact types and values."""
    if len(answer_text.encode("utf-8", "surrogatepass")) > MAX_ANSWER_BYTES:
        return _INVALID
    try:
        value = json.loads(answer_text, object_pairs_hook=_object_without_duplicates, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # malformed, duplicate keys, NaN/Infinity; nesting deeper than Python's
        return _INVALID
    if not isinstance(value, dict):
        return _INVALID
    if _same(value, expected):
        return Check(correct=True, valid_json_object=True, reason="correct")
    return Check(correct=False, valid_json_object=True, reason="wrong_schema_or_value")
