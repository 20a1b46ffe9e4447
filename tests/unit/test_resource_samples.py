"""A rank's resource samples: on a CPU the five whole-process fields only (so that a CPU run's evidence reads as
before), on a GPU also the memory torch holds there, read at each sample, and the rank's preflight figure."""

from __future__ import annotations

import itertools

import msgspec

from experiment.learning.records import ResourceSample
from experiment.learning.resources import Sampler

CPU_FIELDS = {"seconds", "rss_bytes", "cpu_user_seconds", "cpu_system_seconds", "threads"}


def test_a_cpu_sample_writes_the_whole_process_fields_only() -> None:
    with Sampler(interval=0.01) as sampler:
        pass
    written = [msgspec.to_builtins(sample) for sample in sampler.samples]
    assert written and all(set(sample) == CPU_FIELDS for sample in written)
    assert [msgspec.convert(sample, type=ResourceSample) for sample in written] == sampler.samples


def test_a_gpu_sample_reads_the_allocated_memory_each_time_beside_the_preflight_figure() -> None:
    readings = itertools.count(1000, 10)
    with Sampler(interval=0.01, gpu_allocated=lambda: next(readings), preflight_bytes=4096) as sampler:
        pass
    memory = [sample.gpu for sample in sampler.samples]
    assert all(gpu is not None for gpu in memory)
    allocated = [gpu.allocated_bytes for gpu in memory if gpu is not None]
    assert allocated == list(range(1000, 1000 + 10 * len(allocated), 10))
    assert {gpu.preflight_bytes for gpu in memory if gpu is not None} == {4096}
    written = msgspec.to_builtins(sampler.samples[0])
    assert set(written) == CPU_FIELDS | {"gpu"} and written["gpu"] == {"allocated_bytes": 1000, "preflight_bytes": 4096}
