"""The four task families, the generator, the damage rule and the strict checker (docs/protocol.md "The tasks",
"The strict checker" and the damage rule of "The training corpus and the damaged copy").

Hand-computed fixtures pin each family; the generator facts are checked over the whole frozen task set
(train 768, dev 64, test 256 with task seed 2026091301); property tests compare ``experiment.core.tasks``
against an oracle written here from the protocol text alone (answers and strict JSON equality), with
msgspec's JSON decoder as an independent parser.
"""

from __future__ import annotations

import functools
import json
import re
import string
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from experiment.core import tasks
from experiment.core.tasks import Case, Check, Record

TASK_SEED = 2026091301
ROLE_COUNTS = {"train": 768, "dev": 64, "test": 256}
LIMIT = 32_768
ID_PATTERN = re.compile(r"^[A-Z][1-9][0-9]{2}$")
FAMILY_FIELDS = {
    "lookup": {"city", "units"},
    "filter": {"status"},
    "total": {"units", "price"},
    "sort": {"priority"},
}
ALL_FIELDS = {"city", "units", "price", "status", "priority"}
SCHEMA_KEYS = {"lookup": ("city", "units"), "filter": ("ids",), "total": ("total",), "sort": ("ids",)}

CORRECT = Check(correct=True, valid_json_object=True, reason="correct")
WRONG = Check(correct=False, valid_json_object=True, reason="wrong_schema_or_value")
INVALID = Check(correct=False, valid_json_object=False, reason="invalid_json_object")

FAST = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------------------------------
# The independent oracle: answers from the protocol text, strict JSON equality, strict parsing.
# --------------------------------------------------------------------------------------------------


def oracle_answer(family: str, records: tuple[Record, ...], query_id: str | None) -> dict[str, Any]:
    if family == "lookup":
        for record in records:
            if record.id == query_id:
                return {"city": record.city, "units": record.units}
        return {"city": None, "units": None}
    if family == "filter":
        ready = [record.id for record in records if record.status == "ready"]
        ascending: list[str] = []
        for rid in ready:  # insertion sort, on purpose not the implementation's sorted()
            position = 0
            while position < len(ascending) and ascending[position] < rid:
                position += 1
            ascending.insert(position, rid)
        return {"ids": ascending}
    if family == "total":
        total = 0
        for record in records:
            total += record.units * record.price
        return {"total": total}
    assert family == "sort"

    def beats(a: Record, b: Record) -> bool:
        return a.priority > b.priority or (a.priority == b.priority and a.id < b.id)

    remaining = list(records)
    top: list[str] = []
    for _ in range(2):
        best = remaining[0]
        for record in remaining[1:]:
            if beats(record, best):
                best = record
        top.append(best.id)
        remaining.remove(best)
    return {"ids": top}


def json_tag(value: Any) -> Any:
    """A hashable tag that is equal for two JSON values iff they are the same JSON type and value."""
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(json_tag(item) for item in value))
    if isinstance(value, dict):
        return ("object", frozenset((key, json_tag(item)) for key, item in value.items()))
    raise TypeError(type(value))


def json_equal(a: Any, b: Any) -> bool:
    return bool(json_tag(a) == json_tag(b))


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Duplicate
    return dict(pairs)


def oracle_parse(text: str) -> tuple[bool, Any]:
    """(is one strict JSON object within the byte limit, its value)."""
    if len(text.encode("utf-8")) > LIMIT:
        return False, None
    try:
        value = msgspec.json.decode(text)  # strict RFC 8259 grammar: no NaN, no fences, no trailing text
    except msgspec.DecodeError:
        return False, None
    if not isinstance(value, dict):
        return False, None
    try:
        json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate:
        return False, None
    return True, value


def oracle_check(text: str, target: dict[str, Any]) -> Check:
    valid, value = oracle_parse(text)
    if not valid:
        return INVALID
    return CORRECT if json_equal(value, target) else WRONG


# --------------------------------------------------------------------------------------------------
# Helpers and hypothesis strategies
# --------------------------------------------------------------------------------------------------


def rec(
    rid: str, city: str = "Oslo", units: int = 1, price: int = 1, status: str = "pending", priority: int = 1
) -> Record:
    return Record(id=rid, city=city, units=units, price=price, status=status, priority=priority)


def hand_case(family: str, records: list[Record], query_id: str | None = None, index: int = 0) -> Case:
    return Case(
        task_seed=TASK_SEED,
        role="test",
        index=index,
        family=family,  # type: ignore[arg-type]
        variant=0,
        records=tuple(records),
        query_id=query_id,
    )


@functools.cache
def all_cases() -> tuple[tuple[str, int, Case], ...]:
    return tuple(
        (role, index, tasks.make_case(TASK_SEED, role, index))  # type: ignore[arg-type]
        for role, count in ROLE_COUNTS.items()
        for index in range(count)
    )


@functools.cache
def all_prompts() -> dict[str, list[str]]:
    prompts: dict[str, list[str]] = {role: [] for role in ROLE_COUNTS}
    for role, _, case in all_cases():
        prompts[role].append(tasks.render_prompt(case))
    return prompts


def table_lines(prompt: str) -> list[str]:
    return [line for line in prompt.splitlines() if line.startswith("id=")]


def wording_of(case: Case) -> str:
    """The prompt with the record table and the queried id taken out: what is left is the wording."""
    prompt = "\n".join(line for line in tasks.render_prompt(case).splitlines() if not line.startswith("id="))
    return prompt.replace(case.query_id, "{q}") if case.query_id else prompt


ids_st = st.builds(
    lambda letter, number: f"{letter}{number}", st.sampled_from(string.ascii_uppercase), st.integers(100, 999)
)
record_st = st.builds(
    Record,
    id=ids_st,
    city=st.sampled_from(tasks.CITIES),
    units=st.integers(0, 19),
    price=st.integers(1, 19),
    status=st.sampled_from(tasks.STATUSES),
    priority=st.integers(1, 9),
)
records_st = st.lists(record_st, min_size=5, max_size=5, unique_by=lambda r: r.id).map(tuple)


@st.composite
def case_st(draw: st.DrawFn) -> Case:
    records = draw(records_st)
    family = draw(st.sampled_from(tasks.FAMILIES))
    query_id = None
    if family == "lookup":
        present = draw(st.booleans())
        if present:
            query_id = draw(st.sampled_from([r.id for r in records]))
        else:
            query_id = draw(ids_st.filter(lambda q: q not in {r.id for r in records}))
    return hand_case(family, list(records), query_id)


scalar_st = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=6)
)
key_st = st.text(st.characters(codec="utf-8"), max_size=4)
json_value_st = st.recursive(
    scalar_st,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(key_st, children, max_size=3),
    max_leaves=8,
)
json_object_st = st.dictionaries(key_st, json_value_st, max_size=4)


def lookalikes(value: Any) -> list[Any]:
    """Values that a lax checker might take for ``value``: same number or text, other JSON type or order."""
    if value is None:
        return [0, False, "", "null", [], {}]
    if isinstance(value, bool):
        return [int(value), float(value), str(value).lower(), None, not value]
    if isinstance(value, int):
        out: list[Any] = [float(value), str(value), None, value + 1]
        if value in (0, 1):
            out.append(bool(value))
        return out
    if isinstance(value, float):
        out = [str(value), None]
        if value.is_integer() and abs(value) < 2**53:
            out.append(int(value))
        return out
    if isinstance(value, str):
        return [None, [value], value + " ", value.upper()]
    if isinstance(value, list):
        return [list(reversed(value)), value[:-1], [*value, None], first_as_object(value)]
    return [{**value, "extra": 1}, dict(list(value.items())[:-1]), [value]]


def first_as_object(value: list[Any]) -> Any:
    return {"0": value[0]} if value else None


@st.composite
def target_and_candidate(draw: st.DrawFn) -> tuple[dict[str, Any], Any]:
    target = draw(json_object_st)
    how = draw(st.sampled_from(["same", "lookalike", "random", "non_object"]))
    if how == "same":
        return target, json.loads(json.dumps(target))
    if how == "lookalike" and target:
        key = draw(st.sampled_from(sorted(target)))
        candidate = dict(target)
        candidate[key] = draw(st.sampled_from(lookalikes(target[key])))
        return target, candidate
    if how == "non_object":
        return target, draw(st.lists(json_value_st, max_size=2) | scalar_st)
    return target, draw(json_object_st)


# --------------------------------------------------------------------------------------------------
# Hand-computed fixtures, one or more per family
# --------------------------------------------------------------------------------------------------

FIVE = [
    rec("A100", city="Lisbon", units=7, price=2, status="ready", priority=3),
    rec("B200", city="Oslo", units=0, price=19, status="closed", priority=9),
    rec("C300", city="Quito", units=12, price=5, status="pending", priority=9),
    rec("D400", city="Hanoi", units=19, price=1, status="ready", priority=2),
    rec("E500", city="Cusco", units=4, price=11, status="closed", priority=9),
]


def test_present_lookup_answers_city_and_units_of_the_queried_id() -> None:
    case = hand_case("lookup", FIVE, query_id="C300")
    assert tasks.expected_answer(case) == {"city": "Quito", "units": 12}


def test_present_lookup_with_zero_units_answers_zero_not_null() -> None:
    case = hand_case("lookup", FIVE, query_id="B200")
    answer = tasks.expected_answer(case)
    assert answer == {"city": "Oslo", "units": 0}
    assert answer["units"] is not None and answer["units"] is not False


def test_missing_lookup_answers_two_nulls() -> None:
    case = hand_case("lookup", FIVE, query_id="Q999")
    assert tasks.expected_answer(case) == {"city": None, "units": None}
    assert tasks.answer_text(tasks.expected_answer(case)) == '{"city": null, "units": null}'


def test_filter_lists_ready_ids_ascending() -> None:
    shuffled = [FIVE[3], FIVE[1], FIVE[0], FIVE[4], FIVE[2]]  # D400 (ready) is shown before A100 (ready)
    assert tasks.expected_answer(hand_case("filter", shuffled)) == {"ids": ["A100", "D400"]}


def test_filter_with_none_ready_answers_an_empty_list() -> None:
    records = [
        rec("A100", status="pending"),
        rec("B200", status="closed"),
        rec("C300", status="pending"),
        rec("D400", status="closed"),
        rec("E500", status="closed"),
    ]
    case = hand_case("filter", records)
    assert tasks.expected_answer(case) == {"ids": []}
    assert tasks.answer_text(tasks.expected_answer(case)) == '{"ids": []}'


def test_total_includes_zero_unit_records_and_ignores_status() -> None:
    # 7*2 + 0*19 + 12*5 + 19*1 + 4*11 = 14 + 0 + 60 + 19 + 44 = 137 (closed records count too)
    assert tasks.expected_answer(hand_case("total", FIVE)) == {"total": 137}


def test_total_of_all_zero_units_is_zero() -> None:
    records = [rec(f"{letter}100", units=0, price=19) for letter in "ABCDE"]
    answer = tasks.expected_answer(hand_case("total", records))
    assert answer == {"total": 0}
    assert type(answer["total"]) is int


def test_sort_breaks_priority_ties_by_id_ascending() -> None:
    # B200, C300 and E500 all have priority 9: the two smallest ids win, in ascending order.
    shuffled = [FIVE[4], FIVE[2], FIVE[0], FIVE[1], FIVE[3]]
    assert tasks.expected_answer(hand_case("sort", shuffled)) == {"ids": ["B200", "C300"]}


def test_sort_tie_for_second_place_goes_to_the_smaller_id() -> None:
    records = [
        rec("Z500", priority=7),
        rec("K900", priority=8),
        rec("M111", priority=7),
        rec("A999", priority=7),
        rec("B100", priority=1),
    ]
    assert tasks.expected_answer(hand_case("sort", records)) == {"ids": ["K900", "A999"]}


def test_sort_puts_the_higher_priority_first_even_with_the_larger_id() -> None:
    records = [
        rec("A100", priority=2),
        rec("Z999", priority=9),
        rec("Y998", priority=8),
        rec("B200", priority=3),
        rec("C300", priority=1),
    ]
    assert tasks.expected_answer(hand_case("sort", records)) == {"ids": ["Z999", "Y998"]}


@pytest.mark.parametrize(
    ("family", "query_id", "expected"),
    [
        ("lookup", "C300", {"city": "Quito", "units": 13}),
        ("lookup", "Q999", {"city": None, "units": 1}),
        ("filter", None, {"ids": ["A100", "D400", "Z000"]}),
        ("total", None, {"total": 138}),
        ("sort", None, {"ids": ["B200", "C300", "Z000"]}),
    ],
)
def test_damage_rule_by_hand(family: str, query_id: str | None, expected: dict[str, Any]) -> None:
    case = hand_case(family, FIVE, query_id=query_id)
    assert tasks.damaged_answer(case) == expected
    assert tasks.check(tasks.answer_text(expected), tasks.expected_answer(case)) == WRONG


def test_damaged_empty_filter_is_the_damage_id_alone() -> None:
    records = [rec(f"{letter}100", status="closed") for letter in "ABCDE"]
    assert tasks.damaged_answer(hand_case("filter", records)) == {"ids": ["Z000"]}


# --------------------------------------------------------------------------------------------------
# Generator facts over the frozen task set
# --------------------------------------------------------------------------------------------------


def test_family_follows_index_mod_four() -> None:
    for _, index, case in all_cases():
        assert case.family == ("lookup", "filter", "total", "sort")[index % 4]


def test_test_uses_four_wordings_train_and_dev_only_the_first_two() -> None:
    for role, index, case in all_cases():
        expected = (index // 4) % 4 if role == "test" else (index // 4) % 2
        assert case.variant == expected == tasks.variant_of(role, index)  # type: ignore[arg-type]
    assert {c.variant for r, _, c in all_cases() if r == "test"} == {0, 1, 2, 3}
    assert {c.variant for r, _, c in all_cases() if r != "test"} == {0, 1}


def test_case_records_its_seed_role_and_index() -> None:
    for role, index, case in all_cases():
        assert (case.task_seed, case.role, case.index) == (TASK_SEED, role, index)


def test_each_case_has_five_records_with_distinct_well_formed_ids() -> None:
    for _, _, case in all_cases():
        ids = [record.id for record in case.records]
        assert len(ids) == 5 and len(set(ids)) == 5
        for rid in ids:
            assert ID_PATTERN.match(rid), rid
            assert 100 <= int(rid[1:]) <= 999


def test_record_fields_are_in_range() -> None:
    assert len(tasks.CITIES) == 8 and len(set(tasks.CITIES)) == 8
    for _, _, case in all_cases():
        for record in case.records:
            assert record.city in tasks.CITIES
            assert type(record.units) is int and 0 <= record.units <= 19
            assert type(record.price) is int and 1 <= record.price <= 19
            assert record.status in {"ready", "pending", "closed"}
            assert type(record.priority) is int and 1 <= record.priority <= 9


def test_generated_values_cover_their_ranges() -> None:
    records = [record for _, _, case in all_cases() for record in case.records]
    assert {r.units for r in records} == set(range(20))  # zero units do occur
    assert {r.price for r in records} == set(range(1, 20))
    assert {r.priority for r in records} == set(range(1, 10))
    assert {r.city for r in records} == set(tasks.CITIES)
    assert {r.status for r in records} == {"ready", "pending", "closed"}


def test_every_fifth_lookup_asks_for_an_absent_id_the_rest_for_a_present_one() -> None:
    lookups = 0
    for _, index, case in all_cases():
        ids = {record.id for record in case.records}
        if case.family != "lookup":
            assert case.query_id is None
            continue
        lookups += 1
        assert case.query_id is not None
        if index % 5 == 0:
            assert case.query_id not in ids
            assert tasks.expected_answer(case) == {"city": None, "units": None}
        else:
            assert case.query_id in ids
            assert tasks.expected_answer(case)["city"] is not None
    assert lookups == (768 + 64 + 256) // 4


def test_generation_is_deterministic() -> None:
    for role, index, case in all_cases()[::7]:
        again = tasks.make_case(TASK_SEED, role, index)  # type: ignore[arg-type]
        assert again == case
        assert tasks.render_prompt(again) == tasks.render_prompt(case)
        assert tasks.task_id(again) == tasks.task_id(case)


def test_another_task_seed_gives_other_records() -> None:
    assert tasks.make_case(TASK_SEED, "test", 1).records != tasks.make_case(TASK_SEED + 1, "test", 1).records


def test_task_ids_are_sha256_hex_and_unique() -> None:
    ids = [tasks.task_id(case) for _, _, case in all_cases()]
    assert all(re.fullmatch(r"[0-9a-f]{64}", tid) for tid in ids)
    assert len(set(ids)) == len(ids) == 768 + 64 + 256


def test_task_id_depends_on_the_prompt_wording() -> None:
    case = tasks.make_case(TASK_SEED, "test", 1)
    other = msgspec.structs.replace(case, variant=(case.variant + 1) % 4)
    assert tasks.task_id(other) != tasks.task_id(case)


def test_no_prompt_repeats_within_or_across_roles() -> None:
    prompts = all_prompts()
    everything = [prompt for role in ROLE_COUNTS for prompt in prompts[role]]
    assert [len(prompts[role]) for role in ROLE_COUNTS] == [768, 64, 256]
    assert len(set(everything)) == len(everything)
    assert not set(prompts["train"]) & set(prompts["dev"])
    assert not set(prompts["train"]) & set(prompts["test"])
    assert not set(prompts["dev"]) & set(prompts["test"])


def test_prompt_shows_only_the_fields_its_family_needs() -> None:
    for _, _, case in all_cases():
        prompt = tasks.render_prompt(case)
        needed = FAMILY_FIELDS[case.family]
        for name in ALL_FIELDS - needed:
            assert f"{name}=" not in prompt, (case.family, name)
        lines = table_lines(prompt)
        assert len(lines) == 5
        for line, record in zip(lines, case.records, strict=True):
            shown = dict(part.split("=", 1) for part in line.split())
            assert set(shown) == {"id"} | needed
            assert shown["id"] == record.id
            for name in needed:
                assert shown[name] == str(getattr(record, name))


def test_filter_prompt_has_no_units_or_price_and_total_prompt_no_city() -> None:
    for _, _, case in all_cases():
        prompt = tasks.render_prompt(case)
        if case.family == "filter":
            assert "units=" not in prompt and "price=" not in prompt
        if case.family == "total":
            assert "city=" not in prompt and "status=" not in prompt


def test_lookup_prompt_names_the_queried_id() -> None:
    for _, _, case in all_cases():
        if case.family == "lookup":
            assert case.query_id is not None and case.query_id in tasks.render_prompt(case)


def test_every_wording_states_the_output_schema_keys() -> None:
    for _, _, case in all_cases():
        prompt = tasks.render_prompt(case)
        for key in SCHEMA_KEYS[case.family]:
            assert f'"{key}"' in prompt, (case.family, case.variant, key)
        if case.family == "lookup":
            assert "null" in prompt


def test_wordings_two_and_three_never_appear_for_train_or_dev() -> None:
    by_variant: dict[tuple[str, int], set[str]] = {}
    for role, _, case in all_cases():
        if role == "test":
            by_variant.setdefault((case.family, case.variant), set()).add(wording_of(case))
    # each (family, variant) of test is one fixed wording, and the four wordings of a family differ
    assert all(len(wordings) == 1 for wordings in by_variant.values())
    for family in tasks.FAMILIES:
        assert len({next(iter(by_variant[(family, v)])) for v in range(4)}) == 4
    held_out = {family: by_variant[(family, 2)] | by_variant[(family, 3)] for family in tasks.FAMILIES}
    seen = {family: by_variant[(family, 0)] | by_variant[(family, 1)] for family in tasks.FAMILIES}
    for role, _, case in all_cases():
        if role != "test":
            wording = wording_of(case)
            assert wording not in held_out[case.family]
            assert wording in seen[case.family]


def test_every_generated_target_matches_the_oracle_and_passes_the_checker() -> None:
    for _, _, case in all_cases():
        expected = tasks.expected_answer(case)
        assert json_equal(expected, oracle_answer(case.family, case.records, case.query_id))
        assert tasks.check(tasks.answer_text(expected), expected) == CORRECT


def test_make_case_refuses_unknown_roles_and_negative_indices() -> None:
    with pytest.raises(ValueError):
        tasks.make_case(TASK_SEED, "retention", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tasks.make_case(TASK_SEED, "test", -1)


@MANY
@given(role=st.sampled_from(tasks.ROLES), index=st.integers(0, 10**6))
def test_generator_facts_hold_for_any_index(role: str, index: int) -> None:
    case = tasks.make_case(TASK_SEED, role, index)  # type: ignore[arg-type]
    assert case.family == tasks.FAMILIES[index % 4]
    assert case.variant == (index // 4) % (4 if role == "test" else 2)
    ids = [r.id for r in case.records]
    assert len(set(ids)) == 5 and all(ID_PATTERN.match(rid) for rid in ids)
    if case.family == "lookup":
        assert (case.query_id in ids) is (index % 5 != 0)
    expected = tasks.expected_answer(case)
    assert json_equal(expected, oracle_answer(case.family, case.records, case.query_id))
    assert tasks.check(tasks.answer_text(expected), expected) == CORRECT


# --------------------------------------------------------------------------------------------------
# Damaged targets
# --------------------------------------------------------------------------------------------------


def test_every_damaged_target_fails_the_checker() -> None:
    for _, _, case in all_cases():
        expected = tasks.expected_answer(case)
        damaged = tasks.damaged_answer(case)
        assert tasks.check(tasks.answer_text(damaged), expected) == WRONG
        assert not json_equal(damaged, expected)


def test_damage_rule_per_family_over_generated_cases() -> None:
    missing = 0
    for _, _, case in all_cases():
        expected = tasks.expected_answer(case)
        damaged = tasks.damaged_answer(case)
        if case.family == "lookup" and expected["units"] is None:
            missing += 1
            assert damaged == {"city": None, "units": 1}
        elif case.family == "lookup":
            assert damaged == {"city": expected["city"], "units": expected["units"] + 1}
        elif case.family == "total":
            assert damaged == {"total": expected["total"] + 1}
        else:
            assert damaged == {"ids": [*expected["ids"], "Z000"]}
    assert missing > 0


@FAST
@given(case=case_st())
def test_damaged_answer_fails_for_any_records(case: Case) -> None:
    expected = oracle_answer(case.family, case.records, case.query_id)
    damaged = tasks.damaged_answer(case)
    assert not json_equal(damaged, expected)
    assert tasks.check(tasks.answer_text(damaged), expected) == WRONG


# --------------------------------------------------------------------------------------------------
# Oracle property tests for the families
# --------------------------------------------------------------------------------------------------


@FAST
@given(case=case_st())
def test_expected_answer_matches_the_oracle_for_any_records(case: Case) -> None:
    expected = tasks.expected_answer(case)
    oracle = oracle_answer(case.family, case.records, case.query_id)
    assert json_equal(expected, oracle)
    assert list(expected) == list(SCHEMA_KEYS[case.family])  # keys in the order the schema states
    assert tasks.check(tasks.answer_text(expected), oracle) == CORRECT


@FAST
@given(records=records_st, data=st.data())
def test_answers_do_not_depend_on_the_order_records_are_shown(records: tuple[Record, ...], data: st.DataObject) -> None:
    shuffled = tuple(data.draw(st.permutations(records)))
    for family in ("filter", "total", "sort"):
        assert tasks.expected_answer(hand_case(family, list(records))) == tasks.expected_answer(
            hand_case(family, list(shuffled))
        )


# --------------------------------------------------------------------------------------------------
# Strict checker, each edge
# --------------------------------------------------------------------------------------------------

TOTAL = {"total": 31}
LOOKUP = {"city": "Oslo", "units": 1}
MISSING = {"city": None, "units": None}
IDS = {"ids": ["A100", "B200"]}


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ('{"total": 31}', TOTAL),
        ('{"total":31}', TOTAL),
        ('{"city": "Oslo", "units": 1}', LOOKUP),
        ('{"units": 1, "city": "Oslo"}', LOOKUP),  # object key order does not matter
        ('{"city": null, "units": null}', MISSING),
        ('{"ids": ["A100", "B200"]}', IDS),
        ('{"ids": []}', {"ids": []}),
        ('{"city": "\\u004fslo", "units": 1}', LOOKUP),  # escapes are JSON
    ],
)
def test_correct_answer_is_correct(text: str, target: dict[str, Any]) -> None:
    assert tasks.check(text, target) == CORRECT


@pytest.mark.parametrize("around", [" ", "\n", "\t", "\r\n", "  \n\t \r\n  "])
def test_surrounding_json_whitespace_is_allowed(around: str) -> None:
    assert tasks.check(around + '{"total": 31}' + around, TOTAL) == CORRECT
    assert tasks.check(around + '{"total": 31}', TOTAL) == CORRECT
    assert tasks.check('{"total": 31}' + around, TOTAL) == CORRECT


@pytest.mark.parametrize("around", ["\f", "\v", "\u00a0", "\u2028", "\ufeff"])
def test_only_json_whitespace_may_surround_the_object(around: str) -> None:
    assert tasks.check(around + '{"total": 31}', TOTAL) == INVALID
    assert tasks.check('{"total": 31}' + around, TOTAL) == INVALID


@pytest.mark.parametrize(
    "text",
    [
        '{"total": 31, "total": 31}',
        '{"total": 30, "total": 31}',
        '{"city": "Oslo", "units": 1, "city": "Oslo"}',
        '{"total": 31, "x": {"a": 1, "a": 1}}',
    ],
)
def test_duplicate_keys_are_invalid_json_object(text: str) -> None:
    assert tasks.check(text, TOTAL) == INVALID
    assert tasks.check(text, LOOKUP) == INVALID


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinities_are_invalid(constant: str) -> None:
    assert tasks.check(f'{{"total": {constant}}}', TOTAL) == INVALID
    assert tasks.check(f'{{"total": 31, "x": [{constant}]}}', TOTAL) == INVALID
    assert tasks.check(f'{{"city": "Oslo", "units": {constant}}}', LOOKUP) == INVALID


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ('{"ok": true}', {"ok": 1}),  # true is not 1
        ('{"ok": 1}', {"ok": True}),  # 1 is not true
        ('{"ok": 1.0}', {"ok": True}),
        ('{"city": "Oslo", "units": true}', LOOKUP),
        ('{"total": 31.0}', TOTAL),  # 31.0 is not 31
        ('{"total": 3.1e1}', TOTAL),
        ('{"total": "31"}', TOTAL),
        ('{"ok": 0}', {"ok": False}),  # 0 is not false
        ('{"ok": false}', {"ok": 0}),
        ('{"total": null}', TOTAL),  # null only where the target is null
        ('{"city": null, "units": 1}', LOOKUP),
        ('{"city": "Oslo", "units": null}', LOOKUP),
        ('{"city": "null", "units": null}', MISSING),  # a value where null is expected
        ('{"city": null, "units": 0}', MISSING),
        ('{"city": null, "units": false}', MISSING),
        ('{"city": "", "units": null}', MISSING),
        ('{"total": 31, "note": "ok"}', TOTAL),  # extra key
        ('{"city": "Oslo"}', LOOKUP),  # missing key
        ("{}", TOTAL),
        ('{"Total": 31}', TOTAL),
        ('{"ids": ["B200", "A100"]}', IDS),  # list order matters
        ('{"ids": ["A100"]}', IDS),
        ('{"ids": ["A100", "B200", "B200"]}', IDS),
        ('{"ids": "A100 B200"}', IDS),
        ('{"ids": []}', IDS),
        ('{"total": 32}', TOTAL),
        ('{"city": "oslo", "units": 1}', LOOKUP),
        ('{"city": "Oslo ", "units": 1}', LOOKUP),
    ],
)
def test_wrong_schema_or_value(text: str, target: dict[str, Any]) -> None:
    result = tasks.check(text, target)
    assert result == WRONG
    assert result.valid_json_object is True and result.correct is False


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"total": 31}\n```',  # Markdown fences
        '```\n{"total": 31}\n```',
        '`{"total": 31}`',
        '{"total": 31} That is the total.',  # trailing prose
        '{"total": 31}\nDone',
        '{"total": 31}.',
        'Answer: {"total": 31}',  # leading prose
        'The answer is\n{"total": 31}',
        '{"total": 31}{"total": 31}',  # two objects
        '{"total": 31}}',
        '{"total": 31,}',  # trailing comma
        "{'total': 31}",  # single quotes
        "{total: 31}",
        '{"total": 031}',
        '{"total": +31}',
        '{"total": 31',
        "",
        "   ",
        "\n",
        "null",  # non-objects
        "[]",
        '[{"total": 31}]',
        '"{\\"total\\": 31}"',
        "31",
        "true",
        '"total"',
    ],
)
def test_invalid_json_object(text: str) -> None:
    result = tasks.check(text, TOTAL)
    assert result == INVALID
    assert result.valid_json_object is False and result.reason == "invalid_json_object"


def test_check_result_fields_agree() -> None:
    assert tasks.check('{"total": 31}', TOTAL) == Check(correct=True, valid_json_object=True, reason="correct")
    wrong = tasks.check('{"total": 30}', TOTAL)
    assert (wrong.correct, wrong.valid_json_object, wrong.reason) == (False, True, "wrong_schema_or_value")
    invalid = tasks.check("31", TOTAL)
    assert (invalid.correct, invalid.valid_json_object, invalid.reason) == (False, False, "invalid_json_object")


def _padded_to(text: str, size: int) -> str:
    pad = size - len(text.encode("utf-8"))
    assert pad >= 0
    return " " * (pad // 2) + text + "\n" * (pad - pad // 2)


def test_input_exactly_at_the_byte_limit_is_fine() -> None:
    text = _padded_to('{"total": 31}', LIMIT)
    assert len(text.encode("utf-8")) == LIMIT == tasks.MAX_ANSWER_BYTES
    assert tasks.check(text, TOTAL) == CORRECT


def test_input_over_the_byte_limit_is_invalid_even_when_correct() -> None:
    text = _padded_to('{"total": 31}', LIMIT + 1)
    assert json.loads(text) == TOTAL  # otherwise a valid, correct object
    assert tasks.check(text, TOTAL) == INVALID
    assert tasks.check(_padded_to('{"total": 31}', 100_000), TOTAL) == INVALID


def test_byte_limit_counts_utf8_bytes_not_characters() -> None:
    city = "é" * 16_000  # 2 bytes each
    target = {"city": city, "units": 1}
    compact = json.dumps(target, ensure_ascii=False)
    assert len(compact) < LIMIT < len(compact.encode("utf-8")) + 2_000
    at_limit = _padded_to(compact, LIMIT)
    assert len(at_limit) < LIMIT and len(at_limit.encode("utf-8")) == LIMIT
    assert tasks.check(at_limit, target) == CORRECT
    over = _padded_to(compact, LIMIT + 1)
    assert len(over) < LIMIT  # far fewer characters than the limit, but one byte over it
    assert tasks.check(over, target) == INVALID


def test_byte_limit_with_four_byte_characters() -> None:
    target = {"city": "\U0001f600" * 8_000, "units": 1}  # 32,000 bytes of emoji, 8,000 characters
    compact = json.dumps(target, ensure_ascii=False)
    assert tasks.check(_padded_to(compact, LIMIT), target) == CORRECT
    assert tasks.check(_padded_to(compact, LIMIT + 1), target) == INVALID
    # The same object written with \\u escapes is far over the limit: what counts is the text given.
    assert tasks.check(json.dumps(target, ensure_ascii=True), target) == INVALID


def test_deeply_nested_input_under_the_limit_gets_an_outcome_not_an_exception() -> None:
    text = '{"total": ' + "[" * 16_000 + "]" * 16_000 + "}"
    assert len(text.encode("utf-8")) <= LIMIT
    result = tasks.check(text, TOTAL)
    assert result.correct is False and result.reason in {"wrong_schema_or_value", "invalid_json_object"}


# --------------------------------------------------------------------------------------------------
# Oracle property tests for the checker
# --------------------------------------------------------------------------------------------------


def test_oracle_equality_is_strict() -> None:  # the oracle itself, so that the properties below mean something
    assert not json_equal(True, 1) and not json_equal(1, True) and not json_equal(0, False)
    assert not json_equal(31.0, 31) and not json_equal(None, 0) and not json_equal([1, 2], [2, 1])
    assert json_equal({"a": [1, None]}, {"a": [1, None]}) and not json_equal({"a": 1}, {"a": 1, "b": 2})


@FAST
@given(pair=target_and_candidate(), ensure_ascii=st.booleans(), indent=st.sampled_from([None, 0, 2, "\t"]))
def test_checker_is_correct_iff_the_oracle_says_equal(
    pair: tuple[dict[str, Any], Any], ensure_ascii: bool, indent: int | str | None
) -> None:
    target, candidate = pair
    text = json.dumps(candidate, ensure_ascii=ensure_ascii, indent=indent, allow_nan=False)
    result = tasks.check(text, target)
    assert result == oracle_check(text, target)
    if isinstance(candidate, dict):
        assert result.valid_json_object
        assert result.correct is json_equal(candidate, target)
    else:
        assert result == INVALID


@FAST
@given(
    target=json_object_st,
    prefix=st.text(" \t\n\r\f\v\u00a0x`{[,", max_size=4),
    suffix=st.text(" \t\n\r\f\v\u00a0x`}],.", max_size=4),
)
def test_only_json_whitespace_around_an_answer_keeps_it_valid(target: dict[str, Any], prefix: str, suffix: str) -> None:
    text = prefix + json.dumps(target) + suffix
    result = tasks.check(text, target)
    assert result == oracle_check(text, target)
    json_space = set(" \t\n\r")
    assert result.correct is (set(prefix) <= json_space and set(suffix) <= json_space)


@MANY
@given(
    text=st.text('{}[]":, \t\n\r\f0123456789.-truefalsnNIiy', max_size=24),
    target=st.sampled_from(
        [TOTAL, LOOKUP, MISSING, IDS, {"ids": []}, {}, {"": 0}, {"a": None}, {"t": True}, {"f": False}]
    ),
)
def test_checker_agrees_with_an_independent_parser_on_random_text(text: str, target: dict[str, Any]) -> None:
    assume(not re.search(r"[eE][-+]?[0-9]{3}", text))  # msgspec refuses out-of-range floats that JSON allows
    assert tasks.check(text, target) == oracle_check(text, target)


@FAST
@given(target=json_object_st.filter(bool), data=st.data())
def test_duplicate_key_anywhere_in_the_answer_is_invalid(target: dict[str, Any], data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(target)))
    first = json.dumps({key: target[key]})[1:-1]
    rest = json.dumps(target)[1:-1]
    text = "{" + first + ", " + rest + "}"
    assert tasks.check(text, target) == INVALID


@FAST
@given(target=json_object_st.filter(bool), data=st.data(), constant=st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_nan_or_infinity_anywhere_is_invalid(target: dict[str, Any], data: st.DataObject, constant: str) -> None:
    key = data.draw(st.sampled_from(sorted(target)))
    text = json.dumps({**target, key: "@@"}).replace('"@@"', constant)
    assert tasks.check(text, target) == INVALID
