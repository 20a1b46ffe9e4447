"""A benchmark's retry on the same host: the lost attempt's report stays where it was, the retry writes its own,
and the bundle's serving/PHASE.json is the succeeded attempt's file."""

from __future__ import annotations

import datetime
import uuid
from pathlib import Path

from agent import evidence, jobs
from experiment import wire
from experiment.core.canonical import sha256_bytes, write_new_bytes


def _benchmark(number: int) -> wire.Assignment:
    return wire.Assignment(
        job_id=uuid.UUID(int=1),
        attempt_id=uuid.UUID(int=100 + number),
        experiment_id=uuid.UUID(int=2),
        kind="benchmark",
        arm="clean-pair",
        role=None,
        spec={"phase": "single", "endpoints": ["http://127.0.0.1:9001"]},
        number=number,
        rank=0,
        world_size=1,
        master_addr=None,
        master_port=None,
        lease_token="t" * 32,
        lease_expires_at=datetime.datetime.now(datetime.UTC),
    )


def _output(argv: list[str]) -> Path:
    return Path(argv[argv.index("--output") + 1])


def test_a_retried_benchmark_never_meets_the_lost_attempts_report(tmp_path: Path) -> None:
    ws = jobs.Workspace(root=tmp_path, model_dir=tmp_path / "seed", plans_dir=tmp_path)
    benchmark = jobs.handler("benchmark")
    lost, retry = (jobs.Run(job, benchmark.read_spec(job), ws) for job in (_benchmark(0), _benchmark(1)))
    lost_file = _output(benchmark.argv(lost))
    write_new_bytes(lost_file, b'{"lost": true}\n')

    retry_file = _output(benchmark.argv(retry))
    assert retry_file != lost_file and not retry_file.exists()
    write_new_bytes(retry_file, b'{"retry": true}\n')

    named, blobs = evidence.as_blobs(benchmark.evidence(retry))
    assert named == {"serving/single.json": sha256_bytes(b'{"retry": true}\n')}
    assert blobs[named["serving/single.json"]] == b'{"retry": true}\n'
    assert lost_file.read_bytes() == b'{"lost": true}\n'  # kept as it was
