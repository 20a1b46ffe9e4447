"""A gang's ranks share their numerical profile's shared fields or refuse to train, naming the field; the machine
fields (another CPU model) are only recorded. Two real gloo processes exchange their profiles."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT
from tests.support.processes import free_port

RANK = """
import json, sys, torch
from experiment.core.errors import CoopError
from experiment.learning import distributed
from experiment.learning.profile import check_shared
profile = json.loads(sys.argv[1])
world = distributed.world_from_env()
distributed.start(world, "gloo", timeout_seconds=60)
try:
    check_shared(world, profile, torch.device("cpu"))
    print("agreed")
except CoopError as exc:
    print(exc)
distributed.stop(world)
"""


def _gang(first: dict[str, object], second: dict[str, object]) -> list[str]:
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, json.dumps(profile)],
            env={
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PATH": "/usr/bin:/bin",
                "PYTHONPATH": str(ROOT),
            },
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for rank, profile in enumerate((first, second))
    ]
    return [process.communicate(timeout=120)[0].strip() for process in processes]


BASE = {"torch": "2.13.0+cpu", "threads": 1, "device": "cpu", "cpu_model": "AMD EPYC", "cpu_capability": "AVX512"}


def test_ranks_on_two_cpu_models_agree_since_machine_fields_are_only_recorded() -> None:
    other = BASE | {"cpu_model": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", "cpu_capability": "AVX2"}
    assert _gang(BASE, other) == ["agreed", "agreed"]


def test_a_shared_field_that_differs_is_refused_on_every_rank_naming_it() -> None:
    refusals = _gang(BASE, BASE | {"torch": "2.12.0+cpu"})
    for refusal in refusals:
        assert refusal == (
            "the gang's ranks differ in their numerical profile's shared fields (torch: ['2.13.0+cpu', '2.12.0+cpu'])"
        )
