"""Choose DiLoCo's H, outer rate and outer momentum on dev only, before the local-SGD plan is committed.

For each candidate (and for the plan's DDP control, for scale) a plan variant is written with the candidate's
three values, prepared, trained on four gloo ranks, and scored on the dev tasks only:
  - dev answer loss: the mean, over the 64 dev tasks, of the answer tokens' mean nats (teacher-forced, the
    expected answer after the prompt), the final checkpoint's;
  - dev accuracy: `coop evaluate --role dev`'s strict checks.
The rule, fixed before the first run: the lowest dev answer loss wins. Test tasks and retention probes are never
read. One JSON line per candidate, and the whole table as JSON at the end (--out).

    .venv/bin/python scripts/diloco-dev.py --plan plans/local-diloco.toml --seed seeds/tiny --work /tmp/dev \
        --out bench/results/diloco-dev-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiment.core import tasks
from experiment.core.plan import load_plan
from experiment.learning import corpus, evaluation, selection
from experiment.seed import seedmodel, seedtokenizer

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = [(h, rate, momentum) for h in (4, 8, 16, 32) for rate, momentum in ((0.7, 0.9), (1.0, 0.0), (0.5, 0.5))]


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _coop(*args: str, ranks: int = 1) -> None:
    port = _port()
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "experiment.cli", *args],
            env=base | {"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_PORT": str(port)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    for process in processes:
        _, err = process.communicate()
        if process.returncode:
            raise SystemExit(f"coop {' '.join(args)} failed: {err[-2000:]}")


def _variant(text: str, h: int, rate: float, momentum: float) -> str:
    """The plan with DiLoCo's three values replaced (each appears once, in the diloco arm)."""
    for key, value in (("sync_every", h), ("outer_learning_rate", rate), ("outer_momentum", momentum)):
        text, count = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.MULTILINE)
        if count != 1:
            raise SystemExit(f"the plan must name {key} once, in its diloco arm")
    return text


def _dev_loss(home: Path, seed: Path, arm: str) -> float:
    """Mean over dev tasks of the expected answer's mean nats after the prompt, under the arm's final checkpoint."""
    prepared = corpus.load_prepared(home)
    tokenizer = seedtokenizer.read_tokenizer(seed)
    candidate = selection.candidate_for(prepared, arm, seed)
    model = seedmodel.load_model(home / candidate.model_path)
    model.eval()
    losses = []
    for item in prepared.task_items("dev"):
        messages = [
            {"role": "user", "content": item.prompt},
            {"role": "assistant", "content": tasks.answer_text(item.expected)},
        ]
        ids, labels = corpus.encode_conversation(tokenizer, messages, prepared.plan.corpus.max_document_tokens, item.id)
        targets = sum(1 for label in labels if label != corpus.IGNORE)
        probe = corpus.Probe(id=item.id, targets=targets, input_ids=ids, labels=labels)
        losses.append(evaluation.retention_score(model, probe).mean_nats)
    return statistics.fmean(losses)


def _run(plan_text: str, source: Path, work: Path, seed: Path, arm: str) -> dict[str, float]:
    work.mkdir(parents=True)
    plan = work / "plan.toml"
    plan.write_text(plan_text)
    folder = load_plan(source).replay.folder
    if folder is not None:  # the plan's replay files, beside it as they are beside the plan
        (work / folder).symlink_to((source.parent / folder).resolve())
    home = work / "home"
    began = time.monotonic()
    _coop("prepare", "--plan", str(plan), "--home", str(home), "--model-dir", str(seed))
    ranks = load_plan(plan).world_size(arm)
    _coop("train", "--home", str(home), "--model-dir", str(seed), "--arm", arm, ranks=ranks)
    _coop("evaluate", "--home", str(home), "--model-dir", str(seed), "--arm", arm, "--role", "dev")
    summary, _, _ = evaluation.read_answers(evaluation.evaluation_dir(home, "dev", arm))
    return {
        "dev_answer_loss": round(_dev_loss(home, seed, arm), 6),
        "dev_correct": summary.correct,
        "dev_tasks": summary.answers,
        "seconds": round(time.monotonic() - began, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, required=True, help="the local-SGD plan, not yet committed")
    parser.add_argument("--seed", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="a new folder for the runs")
    parser.add_argument("--out", type=Path, required=True, help="the table as JSON")
    args = parser.parse_args()
    text = args.plan.read_text()
    plan = load_plan(args.plan)
    control, diloco = plan.arm("control"), plan.arm("diloco")
    rows = []
    for h, rate, momentum in [(None, None, None), *CANDIDATES]:
        name = control if h is None else f"h{h}-lr{rate}-m{momentum}"
        variant = text if h is None else _variant(text, h, rate, momentum)
        scored = _run(variant, args.plan, args.work / name, args.seed, control if h is None else diloco)
        row = {"arm": control if h is None else diloco, "sync_every": h, "outer_learning_rate": rate}
        row |= {"outer_momentum": momentum, **scored}
        print(json.dumps(row), flush=True)
        rows.append(row)
    chosen = min((row for row in rows if row["sync_every"] is not None), key=lambda row: row["dev_answer_loss"])
    document = {"plan": plan.name, "rule": "lowest dev_answer_loss among the DiLoCo candidates", "chosen": chosen}
    args.out.write_text(json.dumps(document | {"runs": rows}, indent=2) + "\n")
    print(json.dumps({"event": "chosen", **chosen}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
