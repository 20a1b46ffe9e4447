"""Draw docs/images/report.png: the report page of a finished experiment, 1280 pixels wide.

The experiment is the SmolLM2-135M run committed under bench/results/smollm2-135m, recorded into a fresh
coordinator (`coop-server serve` on SQLite in a temporary folder) the way the browser tests build a finished one
(tests.browser.support.finished_experiment): its plan, prepared tasks, training journals and resource samples, the
four test evaluations' answers and the run's report. Debian's Chromium (/usr/bin/chromium, driven by Playwright as
in tests/browser) loads the report page, and the whole page is kept as a PNG of at most 256 colours (Pillow), so
that the picture stays small in the repository.

    .venv/bin/python scripts/screenshot.py                 # writes docs/images/report.png
    .venv/bin/python scripts/screenshot.py --out /tmp/r.png
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test support modules build the experiment: they live beside the packages

from PIL import Image  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from tests.browser.conftest import ARGS, CHROMIUM  # noqa: E402
from tests.browser.support import finished_experiment, host_agent  # noqa: E402
from tests.support.processes import QUICK, CoordinatorProcess  # noqa: E402

WIDTH = 1280


def report_page(url: str, experiment_id: str) -> bytes:
    """The whole report page as Chromium draws it, as PNG bytes."""
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=ARGS)
        try:
            page = browser.new_page(base_url=url, viewport={"width": WIDTH, "height": 900})
            page.goto(f"/experiments/{experiment_id}/report")
            page.get_by_test_id("verdict").wait_for()
            return page.screenshot(full_page=True)
        finally:
            browser.close()


def small(png: bytes) -> bytes:
    """The picture in at most 256 colours: the page is flat colour, text and line figures."""
    picture = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    picture.save(out, format="PNG", optimize=True)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "report.png")
    args = parser.parse_args()
    if not CHROMIUM.exists():
        sys.exit(f"{CHROMIUM} is missing: run `make services` (as root) or `apt-get install chromium`")
    with tempfile.TemporaryDirectory() as folder:
        coordinator = CoordinatorProcess(Path(folder), **QUICK)
        try:
            coordinator.start()
            a, b = host_agent(coordinator, "host-a"), host_agent(coordinator, "host-b")
            experiment = finished_experiment(coordinator, a, b)
            picture = small(report_page(coordinator.url, experiment))
        finally:
            coordinator.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(picture)
    print(f"{args.out}: {len(picture):,} bytes")


if __name__ == "__main__":
    main()
