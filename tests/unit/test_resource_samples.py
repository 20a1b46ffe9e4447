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
    allocated = [sample.gpu_allocated_bytes for sample in sampler.samples]
    assert allocated == list(range(1000, 1000 + 10 * len(allocated), 10))
    assert {sample.preflight_bytes for sample in sampler.samples} == {4096}
    assert set(msgspec.to_builtins(sampler.samples[0])) == CPU_FIELDS | {"gpu_allocated_bytes", "preflight_bytes"}
