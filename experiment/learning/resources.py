"""Timers, whole-host network counters and whole-process resource samples (psutil)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

import psutil

from experiment.core.errors import CoopError
from experiment.learning.records import GpuMemory, NetworkCounters, ResourceSample


def network_counters() -> NetworkCounters:
    per_nic = psutil.net_io_counters(pernic=True)
    interfaces = {
        name: {
            "bytes_sent": c.bytes_sent,
            "bytes_received": c.bytes_recv,
            "packets_sent": c.packets_sent,
            "packets_received": c.packets_recv,
        }
        for name, c in sorted(per_nic.items())
        if not name.startswith("lo")
    }
    return NetworkCounters(
        scope="whole-host, non-loopback interfaces",
        interfaces=interfaces,
        bytes_sent=sum(i["bytes_sent"] for i in interfaces.values()),
        bytes_received=sum(i["bytes_received"] for i in interfaces.values()),
    )


_SELF = psutil.Process()


def written_bytes() -> int:
    """What this process has written so far, every thread's writes and sends to files, pipes and sockets alike
    (Linux's /proc/self/io wchar)."""
    try:
        return int(_SELF.io_counters().write_chars)
    except (AttributeError, psutil.Error) as exc:
        raise CoopError(f"this kernel keeps no count of a process's writes ({exc})") from exc


class Sampler:
    """Samples this whole process every ``interval`` seconds on a daemon thread while in use; on a GPU, with
    ``gpu_allocated`` (what torch holds there now) and the rank's ``preflight_bytes``."""

    def __init__(
        self,
        interval: float = 1.0,
        gpu_allocated: Callable[[], int] | None = None,
        preflight_bytes: int | None = None,
    ) -> None:
        self._interval = interval
        self._gpu_allocated = gpu_allocated
        self._preflight_bytes = preflight_bytes
        self._process = psutil.Process()
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)
        self.samples: list[ResourceSample] = []

    def sample(self) -> ResourceSample:
        with self._process.oneshot():
            cpu = self._process.cpu_times()
            return ResourceSample(
                seconds=round(time.monotonic() - self._start, 3),
                rss_bytes=self._process.memory_info().rss,
                cpu_user_seconds=cpu.user,
                cpu_system_seconds=cpu.system,
                threads=self._process.num_threads(),
                gpu=self._gpu(),
            )

    def _gpu(self) -> GpuMemory | None:
        if self._gpu_allocated is None or self._preflight_bytes is None:
            return None
        return GpuMemory(allocated_bytes=self._gpu_allocated(), preflight_bytes=self._preflight_bytes)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.samples.append(self.sample())

    def __enter__(self) -> Sampler:
        self.samples.append(self.sample())
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())

    @property
    def peak_rss_bytes(self) -> int:
        return max(s.rss_bytes for s in self.samples)
