"""The hosts' resources in a real browser: each host's resident memory and CPU use drawn from every sample its
attempts recorded, and GPU memory with the preflight's figure where samples carry them, redrawn as samples
arrive while an attempt runs."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import Locator, Page, expect

from server.web.render import size
from tests.browser.conftest import screenshot
from tests.browser.support import host_agent
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import create_experiment, operate, sha, train_result

MIB = 2**20
GIB = 2**30


def samples(count: int, base_mib: int, gpu: bool = False) -> list[dict[str, Any]]:
    """Samples as experiment.learning.resources.Sampler takes them, a second apart, memory and CPU going up and down
    (so that no drawn point lies on a line through its neighbours); with ``gpu``, the fields a GPU rank adds."""
    found = []
    cpu = 0.0
    for n in range(count):
        cpu += 0.5 + 0.4 * (n % 3)
        sample: dict[str, Any] = {
            "seconds": float(n),
            "rss_bytes": (base_mib + 3 * n + 11 * (n % 4)) * MIB,
            "cpu_user_seconds": round(0.8 * cpu, 3),
            "cpu_system_seconds": round(0.2 * cpu, 3),
            "threads": 4,
        }
        if gpu:
            sample["gpu"] = {"allocated_bytes": int((20 + n % 5 + n / 10) * GIB), "preflight_bytes": 38 * GIB}
        found.append(sample)
    return found


def drawn(figure: Locator) -> list[int]:
    """How many points each data line of an SVG figure joins (matplotlib clips data lines to the axes, and only
    them), in drawing order."""
    paths: list[str] = figure.locator("svg g[id^='line2d'] path[clip-path]").evaluate_all(
        "paths => paths.map(path => path.getAttribute('d'))"
    )
    return [len(re.findall(r"[ML]", d)) for d in paths]


def test_each_hosts_memory_cpu_and_gpu_are_drawn_from_every_sample_with_the_preflight_figure(
    page: Page, coordinator: CoordinatorProcess
) -> None:
    a, b = host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
    experiment = create_experiment(coordinator, autopilot=False)["id"]
    prepare = a.take("prepare")
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    page.goto(f"/experiments/{experiment}/resources")
    expect(page.get_by_text("No resource sample is recorded yet")).to_be_visible()

    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    taken = {"host-a": samples(40, 900), "host-b": samples(30, 1200)}
    for name, agent in (("host-a", a), ("host-b", b)):
        job = agent.take("train")
        agent.finish(job, result=train_result(str(job.arm)), resource_samples=taken[name])
    rank0, rank1 = a.take("train"), b.take("train")  # the pair runs on: its samples arrive as it runs

    page.goto(f"/experiments/{experiment}/resources")
    page.evaluate("window.notReloaded = true")
    for name in taken:
        recorded = taken[name]  # the truth apart from the page: what the host's agent sent
        rows = page.get_by_test_id(f"attempts-{name}").locator("tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.get_by_test_id("samples")).to_have_text(str(len(recorded)))
        expect(rows.get_by_test_id("peak-rss")).to_have_text(size(max(sample["rss_bytes"] for sample in recorded)))
        expect(rows.get_by_test_id("peak-gpu")).to_have_text("not sampled")
        assert drawn(page.get_by_test_id(f"memory-{name}")) == [len(recorded)]
        assert drawn(page.get_by_test_id(f"cpu-{name}")) == [len(recorded) - 1]  # between two samples each
        expect(page.get_by_test_id(f"gpu-{name}")).to_have_count(0)

    # Rank 0 is a GPU rank: its samples carry the memory torch holds there and the preflight's figure, and arrive as
    # the events `coop train` prints while it trains.
    live = samples(12, 4000, gpu=True)
    where = {"event": "resources", "arm": "clean-pair", "rank": 0, "step": 1}
    a.printed(rank0, 0, *(where | {"index": n} | s for n, s in enumerate(live)))
    gpu = page.get_by_test_id("gpu-host-a")
    expect(gpu.locator("svg")).to_be_visible(timeout=30_000)  # the next redraw, without reloading
    assert page.evaluate("window.notReloaded") is True
    # The rank's GPU memory, and the preflight's figure as a level line over the rank's samples.
    assert drawn(gpu) == [len(live), 2]
    expect(gpu.locator("figcaption")).to_contain_text("the memory the preflight asked of each rank")
    assert drawn(page.get_by_test_id("memory-host-a")) == [len(taken["host-a"]), len(live)]
    rows = page.get_by_test_id("attempts-host-a").locator("tbody tr")
    expect(rows).to_have_count(2)
    pair = rows.filter(has_text="train clean-pair, rank 0")
    expect(pair.get_by_test_id("peak-gpu")).to_have_text(size(max(s["gpu"]["allocated_bytes"] for s in live)))
    expect(pair.get_by_test_id("preflight")).to_have_text(size(38 * GIB))
    expect(page.get_by_test_id("gpu-host-b")).to_have_count(0)

    # Rank 1 reports its samples as events while it trains, as `coop train` prints them.
    reported = samples(8, 1500)
    events = [
        {"event": "resources", "arm": "clean-pair", "rank": 1, "step": 1, "index": n} | s
        for n, s in enumerate(reported)
    ]
    b.printed(rank1, 0, *events)
    rows = page.get_by_test_id("attempts-host-b").locator("tbody tr")
    expect(rows).to_have_count(2, timeout=30_000)
    expect(rows.filter(has_text="train clean-pair, rank 1").get_by_test_id("samples")).to_have_text(str(len(reported)))
    assert drawn(page.get_by_test_id("memory-host-b")) == [len(taken["host-b"]), len(reported)]
    assert page.evaluate("window.notReloaded") is True
    screenshot(page, "resources")

    for path in (f"/experiments/{sha('x')[:8]}-0000-7000-8000-000000000000/resources", "/experiments/nope/resources"):
        response = coordinator.http.get(path)
        assert response.status_code == 404, (path, response.status_code)
