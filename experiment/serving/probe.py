"""The probe: a private HTTP service in front of one replica. ``POST /infer`` answers one prepared dev task,
greedy, with the evaluation's prompt ids, stopping rule, decoding and strict check, the model's identity,
and a bounded retry cache keyed by request id.

Before it listens, the probe asks its replica the first dev tasks and compares the answers with the dev
evaluation of the model the replica serves (experiment.serving.agreement): a replica that does not serve the evaluated
model is never reachable through a probe."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import httpx
import msgspec
import uvicorn
from litestar import Litestar, Request, get, post
from litestar.exceptions import HTTPException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from experiment.core import tasks
from experiment.core.errors import CoopError
from experiment.core.progress import Emit
from experiment.learning.answers import Generation, answer_text, read_answers
from experiment.learning.corpus import Prepared, TaskItem, load_prepared
from experiment.learning.records import Answer, Summary
from experiment.seed.seedtokenizer import SeedTokenizer, read_tokenizer, tokenizer_identity
from experiment.serving import agreement

MAX_BODY_BYTES = 1024
REPLICA_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
FINISHED = ("stop", "length")  # vLLM's finish reasons of a generation that ran to its end
REPLICA_WAIT_SECONDS = 900.0  # how long the probe waits for its replica to start before it gives up

RequestId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class InferRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: RequestId
    task_id: TaskId


class InferAnswer(msgspec.Struct, frozen=True):
    request_id: str
    task_id: str
    model: str  # the replica's served model name: the model's identity
    output_ids: list[int]  # through the first EOS when there is one, as the evaluation records them
    text: str  # the evaluation's decoding: every generated token but the terminating EOS
    ended_with_eos: bool
    hit_token_limit: bool
    check: tasks.Check
    cached: bool  # True: a retry of a request id this probe answered (or is answering) already
    replica_seconds: float


class ProbeHealth(msgspec.Struct, frozen=True):
    status: str
    model: str
    replica: str
    tasks: int
    identity: agreement.Agreement | None  # the replica's answers against the evaluation, checked at start


class Reference(msgspec.Struct, frozen=True):
    """The dev evaluation of the model a probe's replica must serve (its folder's files checked by hash)."""

    summary: Summary
    answers: list[Answer]


class CacheConflict(Exception):
    """A request id already used for another task."""


T = TypeVar("T")


class RetryCache(Generic[T]):
    """Least-recently-used map of request id -> (task id, value), at most ``capacity`` ids."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a retry cache holds at least one request id")
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[str, T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, request_id: str, task_id: str) -> T | None:
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        if entry[0] != task_id:
            raise CacheConflict(f"request id {request_id} was used for task {entry[0]}, not {task_id}")
        self._entries.move_to_end(request_id)
        return entry[1]

    def store(self, request_id: str, task_id: str, value: T) -> None:
        self._entries[request_id] = (task_id, value)
        self._entries.move_to_end(request_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def discard(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


class ReplicaError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class ProbeService:
    """The probe's logic, apart from HTTP: tasks, the replica client, the retry cache."""

    def __init__(
        self,
        items: list[TaskItem],
        tokenizer: SeedTokenizer,
        replica: str,
        max_new_tokens: int,
        cache_size: int,
        client: httpx.AsyncClient,
        ignore_eos: bool = False,
    ) -> None:
        self.items = {item.id: item for item in items}
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id
        self.pad_id = tokenizer.pad_id
        self.replica = replica.rstrip("/")
        self.max_new_tokens = max_new_tokens
        self.cache: RetryCache[asyncio.Future[InferAnswer]] = RetryCache(cache_size)
        self.client = client
        # Benchmarks only (bench/serving.py), never the CLI: every request generates max_new_tokens tokens.
        self.ignore_eos = ignore_eos
        self.model: str | None = None
        self.identity_check: agreement.Agreement | None = None
        # Set when the replica aborts a request itself, as vLLM does to every new request while it drains after
        # SIGTERM (its own /health still answers 200 then); cleared once the replica stops answering at all.
        self.stopping: str | None = None

    async def identity(self) -> str:
        """The replica's one served model name, from its ``/v1/models``."""
        try:
            reply = await self.client.get(f"{self.replica}/v1/models", timeout=5.0)
            reply.raise_for_status()
            names = [str(entry["id"]) for entry in reply.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ReplicaError(503, f"replica {self.replica} is not answering: {exc}") from exc
        if len(names) != 1:
            raise ReplicaError(502, f"replica {self.replica} serves {len(names)} models, not one")
        self.model = names[0]
        return names[0]

    async def health(self) -> ProbeHealth:
        try:
            reply = await self.client.get(f"{self.replica}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            self.stopping = None
            raise ReplicaError(503, f"replica {self.replica} is not answering: {exc}") from exc
        if self.stopping is not None:
            raise ReplicaError(503, f"replica {self.replica} is stopping: {self.stopping}")
        if reply.status_code != 200:
            raise ReplicaError(503, f"replica {self.replica} is not healthy (HTTP {reply.status_code})")
        model = await self.identity()
        return ProbeHealth(
            status="ok", model=model, replica=self.replica, tasks=len(self.items), identity=self.identity_check
        )

    async def wait_for_replica(self, timeout: float) -> str:
        """The replica's model name, once it is healthy."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return (await self.health()).model
            except ReplicaError as exc:
                if time.monotonic() > deadline:
                    raise CoopError(f"the replica did not become healthy within {timeout:.0f} s: {exc.detail}") from exc
            await asyncio.sleep(0.5)

    async def check_identity(self, reference: Reference, device: str) -> agreement.Agreement:
        """The replica answers the reference's first dev tasks as the evaluation of its model did, or is refused
        (agreement.refusal, naming each differing task); never degenerate."""
        return await self.check_answers(reference.summary.candidate.model_identity, reference.answers, device)

    async def check_answers(self, model_identity: str, answers: list[Answer], device: str) -> agreement.Agreement:
        """``check_identity`` against evaluated ``answers`` of the model named ``model_identity``."""
        model = await self.wait_for_replica(REPLICA_WAIT_SECONDS)
        if model_identity != model:
            raise CoopError(
                f"the replica serves model {model[:16]}, the reference evaluation is of {model_identity[:16]}"
            )
        sample = answers[: agreement.identity_tasks(device)]
        served = []
        for answer in sample:
            item = self.items.get(answer.id)
            if item is None:
                raise CoopError(f"the reference answers task {answer.id}, which is not a prepared dev task here")
            try:
                got = await self._generate(InferRequest(request_id=f"identity-{answer.index}", task_id=item.id), item)
            except ReplicaError as exc:
                raise CoopError(f"the replica did not answer dev task {item.id}: {exc.detail}") from exc
            broken = agreement.degenerate(got.output_ids, self.eos_id, self.pad_id)
            if broken is not None:
                raise CoopError(f"the replica's answer to dev task {item.id} (index {item.index}) is {broken}")
            served.append(
                agreement.ServedAnswer(task_id=item.id, output_ids=got.output_ids, text=got.text, check=got.check)
            )
        expected = {a.id: a for a in sample}
        refused = agreement.refusal(expected, served, device)
        if refused is not None:
            raise CoopError(f"the replica does not answer as the evaluated model {model[:16]} did: {refused}")
        self.identity_check = agreement.compare(expected, served)
        return self.identity_check

    async def infer(self, request: InferRequest) -> InferAnswer:
        item = self.items.get(request.task_id)
        if item is None:
            raise HTTPException(status_code=404, detail=f"task {request.task_id} is not a prepared dev task")
        try:
            pending = self.cache.lookup(request.request_id, request.task_id)
        except CacheConflict as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc
        if pending is not None:
            answer = await asyncio.shield(pending)
            return msgspec.structs.replace(answer, cached=True)
        future: asyncio.Future[InferAnswer] = asyncio.get_running_loop().create_future()
        self.cache.store(request.request_id, request.task_id, future)
        try:
            answer = await self._generate(request, item)
        except BaseException as exc:
            # A failed attempt is not remembered: the client's retry with the same id tries again.
            self.cache.discard(request.request_id)
            future.set_exception(exc if isinstance(exc, Exception) else ReplicaError(503, "the request was cancelled"))
            future.exception()  # waiters see it; nobody else has to
            raise
        future.set_result(answer)
        return answer

    async def _generate(self, request: InferRequest, item: TaskItem) -> InferAnswer:
        model = self.model if self.model is not None else await self.identity()
        body = {
            "model": model,
            "prompt": item.prompt_ids,
            "max_tokens": self.max_new_tokens,
            "temperature": 0.0,
            # The evaluation's one stopping token (an explicit stop token would stop even with ignore_eos).
            "stop_token_ids": [] if self.ignore_eos else [self.eos_id],
            "skip_special_tokens": False,
            "return_token_ids": True,
            "ignore_eos": self.ignore_eos,
        }
        began = time.monotonic()
        try:
            reply = await self.client.post(f"{self.replica}/v1/completions", json=body, timeout=REPLICA_TIMEOUT)
        except httpx.HTTPError as exc:
            raise ReplicaError(503, f"replica {self.replica} is not answering: {exc}") from exc
        seconds = time.monotonic() - began
        if reply.status_code == 404:
            self.model = None  # the replica may serve another model now; the next health check says which
        if reply.status_code != 200:
            raise ReplicaError(502, f"replica {self.replica} answered HTTP {reply.status_code}: {reply.text[:300]}")
        try:
            choice = reply.json()["choices"][0]
            prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
            output_ids = [int(t) for t in choice["token_ids"]]
            finish_reason = choice["finish_reason"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ReplicaError(502, f"replica {self.replica} sent a completion without token ids: {exc}") from exc
        if finish_reason not in FINISHED:
            # An aborted generation is cut short: never an answer. Another replica may answer the retry.
            if finish_reason == "abort":
                self.stopping = f"it aborted task {item.id}"
            raise ReplicaError(503, f"replica {self.replica} did not finish task {item.id}: {finish_reason}")
        if prompt_ids != item.prompt_ids:
            raise ReplicaError(502, f"replica {self.replica} changed the prompt token ids of task {item.id}")
        generation = self._generation(output_ids)
        text = answer_text(self.tokenizer, generation)
        return InferAnswer(
            request_id=request.request_id,
            task_id=item.id,
            model=model,
            output_ids=generation.output_ids,
            text=text,
            ended_with_eos=generation.ended_with_eos,
            hit_token_limit=generation.hit_token_limit,
            check=tasks.check(text, item.expected),
            cached=False,
            replica_seconds=round(seconds, 6),
        )

    def _generation(self, output_ids: list[int]) -> Generation:
        """The evaluation's reading of generated ids: through the first EOS, else up to the token limit."""
        if len(output_ids) > self.max_new_tokens:
            raise ReplicaError(502, f"replica {self.replica} generated more than {self.max_new_tokens} tokens")
        if self.eos_id in output_ids and not self.ignore_eos:
            kept = output_ids[: output_ids.index(self.eos_id) + 1]
            return Generation(output_ids=kept, ended_with_eos=True, hit_token_limit=False)
        return Generation(
            output_ids=output_ids, ended_with_eos=False, hit_token_limit=len(output_ids) >= self.max_new_tokens
        )


def _authorize(request: Request[Any, Any, Any], token: str) -> None:
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
        raise HTTPException(
            status_code=401, detail="a valid serving token is required", headers={"WWW-Authenticate": "Bearer"}
        )


def create_app(service: ProbeService, token: str) -> Litestar:
    @post("/infer", status_code=200, request_max_body_size=MAX_BODY_BYTES, operation_id="infer")
    async def infer(request: Request[Any, Any, Any]) -> InferAnswer:
        _authorize(request, token)
        try:
            body = await request.body()
        except RequestEntityTooLarge as exc:
            raise HTTPException(status_code=413, detail=f"the request body is over {MAX_BODY_BYTES} bytes") from exc
        try:
            parsed = msgspec.json.decode(body, type=InferRequest)
        except msgspec.ValidationError as exc:
            raise HTTPException(status_code=400, detail=f"invalid request: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise HTTPException(status_code=400, detail=f"the request body is not JSON: {exc}") from exc
        try:
            return await service.infer(parsed)
        except ReplicaError as exc:
            raise HTTPException(status_code=exc.status, detail=exc.detail) from exc

    @get("/health", operation_id="health")
    async def health(request: Request[Any, Any, Any]) -> ProbeHealth:
        _authorize(request, token)
        try:
            return await service.health()
        except ReplicaError as exc:
            raise HTTPException(status_code=503, detail=exc.detail) from exc

    async def close_client() -> None:
        await service.client.aclose()

    return Litestar(route_handlers=[infer, health], openapi_config=None, on_shutdown=[close_client])


def read_reference(folder: Path, prepared_identity: str) -> Reference:
    """A finished dev evaluation (``evaluations/dev/ARM``) of these prepared inputs, its files checked by hash."""
    if not (folder / "evaluation.json").is_file():
        raise CoopError(f"{folder} holds no finished evaluation to check the replica's answers against")
    summary, answers, _ = read_answers(folder)
    if summary.role != "dev" or summary.prepared_identity != prepared_identity:
        raise CoopError(f"{folder} is not a dev evaluation of these prepared inputs")
    return Reference(summary=summary, answers=answers)


def build_service(prepared: Prepared, model_dir: Path, replica: str, ignore_eos: bool = False) -> ProbeService:
    """The probe of a prepared home: its dev tasks, and the tokenizer the home was prepared with."""
    recorded = prepared.manifest.tokenizer_identity
    found = tokenizer_identity(model_dir)
    if found != recorded:
        raise CoopError(f"the tokenizer in {model_dir} is not the one {prepared.home} was prepared with")
    serving = prepared.plan.serving
    return ProbeService(
        items=prepared.task_items("dev"),
        tokenizer=read_tokenizer(model_dir),
        replica=replica,
        max_new_tokens=serving.max_new_tokens,
        cache_size=serving.retry_cache_size,
        client=httpx.AsyncClient(),
        ignore_eos=ignore_eos,
    )


async def _serve(app: Litestar, host: str, port: int, emit: Emit, info: dict[str, str | int]) -> None:
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        emit({"event": "listening", **info})
    await serving
    if not server.started:
        raise CoopError(f"the probe could not listen on {host}:{port}")
    emit({"event": "stopped", **info})


def run(
    home: Path,
    model_dir: Path,
    replica: str,
    host: str,
    port: int,
    token: str,
    emit: Emit,
    reference_dir: Path | None,
    ignore_eos: bool = False,
) -> None:
    """``coop probe``: check the replica against ``reference_dir`` (a dev evaluation of its model; None only for
    bench/serving.py, whose answers are forced past EOS), then serve until SIGTERM/SIGINT, and exit 0."""
    prepared = load_prepared(home)
    service = build_service(prepared, model_dir, replica, ignore_eos)
    reference = None if reference_dir is None else read_reference(reference_dir, prepared.identity)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    info: dict[str, str | int] = {"url": url, "replica": service.replica, "tasks": len(service.items)}

    def noted(number: int, frame: object) -> None:
        del number, frame  # uvicorn re-raises the signal it shut down for; it has been handled

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request to the replica

    async def main() -> None:
        # Until it serves, a stop ends the probe at once (the default handlers); uvicorn handles it from then on.
        if reference is not None:
            device = prepared.plan.runtime.device
            asked = min(agreement.identity_tasks(device), len(reference.answers))
            emit({"event": "checking", "replica": service.replica, "tasks": asked})
            checked = await service.check_identity(reference, device)
            info["identity"] = msgspec.to_builtins(checked)
        previous = {sig: signal.signal(sig, noted) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            await _serve(create_app(service, token), host, port, emit, info)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    asyncio.run(main())
