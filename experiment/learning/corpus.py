"""``prepare``: the roles (train, dev, test, retention), chat-template tokenization with answer-only
labels, the damaged copy and the prepared manifest whose identity is committed before training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from experiment.core import tasks
from experiment.core.canonical import canonical_bytes, identity, read_json, sha256_bytes, write_new_bytes
from experiment.core.errors import CoopError
from experiment.core.layout import MANIFEST, PLAN, PREPARED
from experiment.core.members import member
from experiment.core.plan import Plan, SourceFile, plan_identity, staged_seed
from experiment.core.progress import Emit
from experiment.learning.records import FileRecord, Manifest, RoleFile, SeedRecord, TargetCounts
from experiment.seed.seedfiles import Snapshot, verify_seed
from experiment.seed.seedtokenizer import SeedTokenizer, read_tokenizer, tokenizer_identity

IGNORE = -100
ROLE_FILES = {
    "train-clean": "train-clean.jsonl",
    "train-damaged": "train-damaged.jsonl",
    "dev": "dev.jsonl",
    "test": "test.jsonl",
    "retention": "retention.jsonl",
}


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant"]
    content: str


class Conversation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    messages: list[Message]


class Document(msgspec.Struct, frozen=True):
    """One training document: every token, and labels only on assistant answers (else -100)."""

    position: int
    id: str
    kind: Literal["grounded", "replay"]
    weight: int
    damaged: bool
    targets: int
    input_ids: list[int]
    labels: list[int]


class TaskItem(msgspec.Struct, frozen=True):
    """One dev or test task: its prompt, its prompt token ids and the expected answer."""

    id: str
    role: tasks.Role
    index: int
    family: tasks.Family
    variant: int
    input_dependent: bool
    prompt: str
    expected: tasks.ExpectedAnswer
    prompt_ids: list[int]


class Probe(msgspec.Struct, frozen=True):
    """One retention probe: a conversation whose answer-token loss is measured."""

    id: str
    targets: int
    input_ids: list[int]
    labels: list[int]


def prompt_ids(tokenizer: SeedTokenizer, prompt: str) -> list[int]:
    """The evaluation prompt: the user turn with the generation prompt."""
    return tokenizer.encode(tokenizer.render([{"role": "user", "content": prompt}], add_generation_prompt=True))


def encode_conversation(
    tokenizer: SeedTokenizer, messages: list[dict[str, str]], max_tokens: int, name: str
) -> tuple[list[int], list[int]]:
    """Render with the chat template; label every assistant answer through its first EOS, nothing else.
    Longer than ``max_tokens`` is refused, never truncated."""
    eos = tokenizer.eos_token
    text = tokenizer.render(messages)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.render(messages[:k], add_generation_prompt=True))
        end = text.find(eos, start + len(message["content"]))
        if end < 0 or not text[start:].startswith(message["content"]):
            raise CoopError(f"{name}: the chat template does not render answer {k} where expected")
        spans.append((start, end + len(eos)))
    input_ids, offsets = tokenizer.encode_with_offsets(text)
    if len(input_ids) > max_tokens:
        raise CoopError(
            f"{name} has {len(input_ids)} tokens, over the plan's {max_tokens}; it is refused, not truncated"
        )
    labels = [IGNORE] * len(input_ids)
    for position, (first, last) in enumerate(offsets):
        for start, end in spans:
            if start <= first and last <= end:
                labels[position] = input_ids[position]
            elif first < end and start < last:
                raise CoopError(f"{name}: token {position} straddles the edge of an answer")
    return input_ids, labels


def _source_bytes(folder: Path, source: SourceFile, label: str) -> bytes:
    path = folder / source.path
    if not path.is_file():
        raise CoopError(f"{label} file {path} does not exist (the plan's replay.{label}.path in {folder})")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CoopError(f"cannot read {label} file {path}: {exc.strerror}") from exc


def _read_source(folder: Path, source: SourceFile, count: int, label: str) -> tuple[list[Conversation], str]:
    """The file's conversations, from the bytes whose sha256 was checked against the plan's (read once)."""
    if source.sha256 is None:
        raise CoopError(
            f"the plan records no replay.{label}.sha256 for {source.path}; stage it first "
            "(coop reference-home snapshot)"
        )
    data = _source_bytes(folder, source, label)
    digest = sha256_bytes(data)
    if digest != source.sha256:
        raise CoopError(
            f"{label} file {folder / source.path} has sha256 {digest}; the plan's replay.{label}.sha256 is "
            f"{source.sha256}"
        )
    return _conversations(folder / source.path, data, count), digest


def _conversations(path: Path, data: bytes, count: int) -> list[Conversation]:
    conversations = []
    for number, line in enumerate(data.splitlines(), start=1):
        try:
            conversations.append(msgspec.json.decode(line, type=Conversation))
        except msgspec.ValidationError as exc:
            raise CoopError(f"{path} line {number}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise CoopError(f"{path} line {number} is not JSON: {exc}") from exc
    if len(conversations) < count:
        raise CoopError(f"{path} holds {len(conversations)} conversations; the plan needs {count}")
    for conversation in conversations[:count]:
        roles = [m.role for m in conversation.messages if m.role != "system"]
        if not roles or roles[-1] != "assistant" or roles[::2] != ["user"] * len(roles[::2]) or "user" in roles[1::2]:
            raise CoopError(
                f"{path}: conversation {conversation.id} must alternate user/assistant turns and end with an answer"
            )
    return conversations[:count]


def _messages(conversation: Conversation) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in conversation.messages]


def _jsonl(items: list[Any]) -> bytes:
    return b"".join(canonical_bytes(msgspec.to_builtins(item)) + b"\n" for item in items)


def _replay_folder(plan: Plan, plan_path: Path, reference_home: Path | None) -> Path:
    if plan.replay.source == "repository":
        assert plan.replay.folder is not None  # the plan's own validation guarantees it
        return plan_path.parent / plan.replay.folder
    if reference_home is None:
        raise CoopError(f"plan {plan.name} reads replay and retention from a reference home: give --reference-home")
    return reference_home


def seed_snapshot(plan: Plan) -> Snapshot:
    """The seed's file hashes as the plan records them (staged before the plan is committed)."""
    return msgspec.convert(staged_seed(plan), type=Snapshot)


def _task_items(plan: Plan, tokenizer: SeedTokenizer, role: tasks.Role, count: int) -> list[TaskItem]:
    items = []
    for index in range(count):
        case = tasks.make_case(plan.tasks.task_seed, role, index)
        prompt = tasks.render_prompt(case)
        expected = tasks.expected_answer(case)
        _checked_target(case, expected, True, f"{role} task {index}")
        items.append(
            TaskItem(
                id=tasks.task_id(case),
                role=role,
                index=index,
                family=case.family,
                variant=case.variant,
                input_dependent=tasks.is_input_dependent(case),
                prompt=prompt,
                expected=expected,
                prompt_ids=prompt_ids(tokenizer, prompt),
            )
        )
    return items


def _checked_target(case: tasks.Case, answer: tasks.ExpectedAnswer, must_pass: bool, name: str) -> str:
    """Every target is checked before tokenization: clean ones must pass, damaged ones must fail."""
    text = tasks.answer_text(answer)
    if tasks.check(text, tasks.expected_answer(case)).correct != must_pass:
        raise CoopError(
            f"{name}: its {'clean' if must_pass else 'damaged'} target {'fails' if must_pass else 'passes'} the checker"
        )
    return text


def is_damaged(task_id: str) -> bool:
    return int(task_id, 16) % 4 == 0


def _document(
    position: int,
    document_id: str,
    kind: Literal["grounded", "replay"],
    weight: int,
    damaged: bool,
    input_ids: list[int],
    labels: list[int],
) -> Document:
    """The document of one encoded conversation: its targets are the tokens it has labels on."""
    targets = sum(x != IGNORE for x in labels)
    return Document(
        position=position,
        id=document_id,
        kind=kind,
        weight=weight,
        damaged=damaged,
        targets=targets,
        input_ids=input_ids,
        labels=labels,
    )


def _documents(
    plan: Plan,
    tokenizer: SeedTokenizer,
    cases: list[tasks.Case],
    replay: list[Conversation],
    damaged: bool,
    emit: Emit,
) -> list[Document]:
    documents: list[Document] = []
    limit = plan.corpus.max_document_tokens
    total = len(cases) + len(replay)
    label = "tokenize-damaged" if damaged else "tokenize-clean"
    for case in cases:
        task = tasks.task_id(case)
        name = f"train task {case.index} ({task})"
        harm = damaged and is_damaged(task)
        answer = tasks.damaged_answer(case) if harm else tasks.expected_answer(case)
        prompt = tasks.render_prompt(case)
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _checked_target(case, answer, not harm, name)},
        ]
        input_ids, labels = encode_conversation(tokenizer, messages, limit, name)
        evaluation_prompt = prompt_ids(tokenizer, prompt)
        if input_ids[: len(evaluation_prompt)] != evaluation_prompt:
            raise CoopError(f"{name}: the document does not start with the evaluation prompt's tokens")
        documents.append(_document(case.index, task, "grounded", plan.corpus.grounded_weight, harm, input_ids, labels))
        if case.index % 64 == 63:
            emit({"event": label, "done": len(documents), "total": total})
    for conversation in replay:
        input_ids, labels = encode_conversation(
            tokenizer, _messages(conversation), limit, f"replay conversation {conversation.id}"
        )
        weight = plan.corpus.replay_weight
        documents.append(_document(len(documents), conversation.id, "replay", weight, False, input_ids, labels))
    emit({"event": label, "done": len(documents), "total": total})
    return documents


def _target_counts(documents: list[Document]) -> TargetCounts:
    grounded = [d for d in documents if d.kind == "grounded"]
    replay = [d for d in documents if d.kind == "replay"]
    return TargetCounts(
        documents=len(documents),
        grounded_documents=len(grounded),
        replay_documents=len(replay),
        damaged_documents=sum(d.damaged for d in documents),
        targets=sum(d.targets for d in documents),
        grounded_targets=sum(d.targets for d in grounded),
        replay_targets=sum(d.targets for d in replay),
        weighted_targets=sum(d.targets * d.weight for d in documents),
        grounded_weighted_targets=sum(d.targets * d.weight for d in grounded),
    )


@dataclass(frozen=True)
class _Sources:
    """The replay and retention conversations the plan names, each file checked against its recorded sha256."""

    replay: list[Conversation]
    replay_sha256: str
    retention: list[Conversation]
    retention_sha256: str


def _read_sources(plan: Plan, plan_path: Path, reference_home: Path | None) -> _Sources:
    folder = _replay_folder(plan, plan_path, reference_home)
    replay, replay_sha = _read_source(folder, plan.replay.replay, plan.tasks.replay, "replay")
    retention, retention_sha = _read_source(folder, plan.replay.retention, plan.tasks.retention, "retention")
    if {c.id for c in replay} & {c.id for c in retention}:
        raise CoopError("replay and retention conversations share ids; the roles must be disjoint")
    return _Sources(replay=replay, replay_sha256=replay_sha, retention=retention, retention_sha256=retention_sha)


def check_reference_home(plan: Plan, folder: Path) -> None:
    """A CoopError unless ``folder`` holds the plan's replay and retention files as prepare will read them: the
    recorded sha256, enough conversations, each well formed, no id in both."""
    _read_sources(plan, Path(), folder)


def reference_snapshot(plan: Plan, folder: Path) -> dict[str, str]:
    """The sha256 of the plan's replay and retention files in ``folder`` (a reference home), by role, once both
    hold what prepare will need of them: to be recorded as the plan's replay.replay.sha256 and
    replay.retention.sha256 before the plan is committed."""
    if plan.replay.source != "reference-home":
        raise CoopError(f"plan {plan.name} reads its replay set from {plan.replay.folder}, not a reference home")
    digests = {
        label: sha256_bytes(_source_bytes(folder, getattr(plan.replay, label), label))
        for label in ("replay", "retention")
    }
    replace = msgspec.structs.replace
    staged = replace(
        plan.replay,
        replay=replace(plan.replay.replay, sha256=digests["replay"]),
        retention=replace(plan.replay.retention, sha256=digests["retention"]),
    )
    _read_sources(replace(plan, replay=staged), Path(), folder)  # parsed, counted and disjoint, as prepare needs
    return digests


@dataclass(frozen=True)
class _Roles:
    """Every role built in memory, before anything is written."""

    clean: list[Document]
    damaged: list[Document]
    dev: list[TaskItem]
    test: list[TaskItem]
    probes: list[Probe]

    def contents(self) -> dict[str, bytes]:
        """Each role file's bytes, by the role's name in ROLE_FILES."""
        return {
            "train-clean": _jsonl(self.clean),
            "train-damaged": _jsonl(self.damaged),
            "dev": _jsonl(self.dev),
            "test": _jsonl(self.test),
            "retention": _jsonl(self.probes),
        }

    def ids(self) -> dict[str, list[str]]:
        return {
            "train": [d.id for d in self.clean],
            "dev": [t.id for t in self.dev],
            "test": [t.id for t in self.test],
            "retention": [p.id for p in self.probes],
        }


def _probes(plan: Plan, tokenizer: SeedTokenizer, retention: list[Conversation]) -> list[Probe]:
    probes = []
    for conversation in retention:
        input_ids, labels = encode_conversation(
            tokenizer, _messages(conversation), plan.corpus.max_document_tokens, f"retention probe {conversation.id}"
        )
        probes.append(
            Probe(id=conversation.id, targets=sum(x != IGNORE for x in labels), input_ids=input_ids, labels=labels)
        )
    return probes


def _build_roles(plan: Plan, tokenizer: SeedTokenizer, sources: _Sources, emit: Emit) -> _Roles:
    """The tasks of every role, refused if any repeats, then the clean and damaged documents and the probes."""
    cases = [tasks.make_case(plan.tasks.task_seed, "train", index) for index in range(plan.tasks.train)]
    dev = _task_items(plan, tokenizer, "dev", plan.tasks.dev)
    test = _task_items(plan, tokenizer, "test", plan.tasks.test)
    _refuse_repeats(cases, dev + test)
    emit({"event": "tasks", "train": len(cases), "dev": len(dev), "test": len(test)})
    return _Roles(
        clean=_documents(plan, tokenizer, cases, sources.replay, damaged=False, emit=emit),
        damaged=_documents(plan, tokenizer, cases, sources.replay, damaged=True, emit=emit),
        dev=dev,
        test=test,
        probes=_probes(plan, tokenizer, sources.retention),
    )


def _manifest(
    plan: Plan, snapshot: Snapshot, model_dir: Path, sources: _Sources, roles: _Roles, contents: dict[str, bytes]
) -> Manifest:
    return Manifest(
        plan=plan.name,
        plan_identity=plan_identity(plan),
        seed=SeedRecord(
            name=plan.seed.name,
            revision=plan.seed.revision,
            snapshot_identity=identity(msgspec.to_builtins(snapshot)),
        ),
        tokenizer_identity=tokenizer_identity(model_dir),
        sources={
            "replay": FileRecord(path=plan.replay.replay.path, sha256=sources.replay_sha256),
            "retention": FileRecord(path=plan.replay.retention.path, sha256=sources.retention_sha256),
        },
        roles={name: RoleFile(file=ROLE_FILES[name], sha256=sha256_bytes(data)) for name, data in contents.items()},
        ids=roles.ids(),
        damaged_ids=[d.id for d in roles.damaged if d.damaged],
        target_counts={"clean": _target_counts(roles.clean), "damaged": _target_counts(roles.damaged)},
        retention_targets=sum(p.targets for p in roles.probes),
    )


def _write_prepared(out: Path, files: dict[str, bytes]) -> None:
    """Every file is checked before any is written: a home holding other inputs is left unchanged."""
    for name, data in files.items():
        existing = out / name
        if existing.exists() and existing.read_bytes() != data:
            raise CoopError(f"{existing} already holds different prepared inputs; use a fresh home")
    for name, data in files.items():
        write_new_bytes(out / name, data)


def prepare(
    plan: Plan, plan_path: Path, home: Path, model_dir: Path, reference_home: Path | None, emit: Emit
) -> Manifest:
    """Build every role in memory, refuse anything inconsistent, then write the files and the manifest.

    A home that already holds the same inputs is accepted unchanged; different inputs are refused
    before anything is written."""
    snapshot = seed_snapshot(plan)
    verify_seed(model_dir, snapshot)
    emit({"event": "seed-verified", "files": len(snapshot.files)})
    sources = _read_sources(plan, plan_path, reference_home)
    roles = _build_roles(plan, read_tokenizer(model_dir), sources, emit)
    contents = roles.contents()
    manifest = _manifest(plan, snapshot, model_dir, sources, roles, contents)
    files = {ROLE_FILES[name]: data for name, data in contents.items()}
    files[PLAN] = canonical_bytes(msgspec.to_builtins(plan)) + b"\n"
    files[MANIFEST] = canonical_bytes(msgspec.to_builtins(manifest)) + b"\n"
    _write_prepared(home / PREPARED, files)
    return manifest


def _refuse_repeats(train: list[tasks.Case], evaluated: list[TaskItem]) -> None:
    """No task id and no prompt may appear in two roles (or twice in one)."""
    seen: dict[str, str] = {}
    keys = [(tasks.task_id(c), "train") for c in train] + [(tasks.render_prompt(c), "train") for c in train]
    keys += [(t.id, t.role) for t in evaluated] + [(t.prompt, t.role) for t in evaluated]
    for key, role in keys:
        if key in seen:
            raise CoopError(f"a {role} task repeats a {seen[key]} task or prompt ({key[:64]!r})")
        seen[key] = role


def prepared_identity(manifest: Manifest) -> str:
    """The prepared identity: the identity of the manifest's canonical JSON."""
    return identity(msgspec.to_builtins(manifest))


class Prepared(msgspec.Struct, frozen=True):
    """A home's verified prepared inputs: the plan, the manifest and its identity."""

    home: Path
    plan: Plan
    manifest: Manifest
    identity: str

    def role_bytes(self, role: str) -> bytes:
        """A role file's bytes, verified against the manifest's sha256."""
        entry = self.manifest.roles[role]
        path = member(self.home, PREPARED, entry.file, f"{PREPARED}/{MANIFEST} roles.{role}.file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CoopError(f"cannot read prepared file {path}: {exc.strerror}") from exc
        if sha256_bytes(data) != entry.sha256:
            raise CoopError(f"prepared file {path} does not match the manifest's sha256")
        return data

    def documents(self, role: Literal["train-clean", "train-damaged"]) -> list[Document]:
        return [msgspec.json.decode(line, type=Document) for line in self.role_bytes(role).splitlines()]

    def task_items(self, role: Literal["dev", "test"]) -> list[TaskItem]:
        return [msgspec.json.decode(line, type=TaskItem) for line in self.role_bytes(role).splitlines()]

    def probes(self) -> list[Probe]:
        return [msgspec.json.decode(line, type=Probe) for line in self.role_bytes("retention").splitlines()]


def load_prepared(home: Path) -> Prepared:
    """Read a home's manifest and plan and check that they belong together."""
    folder = home / PREPARED
    recorded = read_json(folder / MANIFEST)
    try:
        manifest = msgspec.convert(recorded, type=Manifest)
    except msgspec.ValidationError as exc:
        raise CoopError(f"{folder / MANIFEST} is not a prepared manifest: {exc}") from exc
    try:
        plan = msgspec.convert(read_json(folder / PLAN), type=Plan)
    except msgspec.ValidationError as exc:
        raise CoopError(f"{folder / PLAN} is not a valid plan: {exc}") from exc
    if plan_identity(plan) != manifest.plan_identity:
        raise CoopError(f"{folder / PLAN} is not the plan the manifest was prepared from")
    # The identity of the file as written, which the typed manifest reproduces field for field.
    return Prepared(home=home, plan=plan, manifest=manifest, identity=identity(recorded))
