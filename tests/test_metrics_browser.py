"""The HTML metrics report as a person sees it: opened from a file in a real headless Chromium
with every network request refused, so it must carry everything it needs (plotly.js included).

Needs /usr/bin/chromium (tests/install-system.sh installs it); ORCHESTRATOR_SKIP_BROWSER_TESTS=1
skips these tests instead.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import chromium
from playwright.sync_api import Browser, Page, Route
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_metrics_report import JOB, write_job

from orchestrator.client.api import get_job
from orchestrator.client.metrics_plot import write_report
from orchestrator.storage.root import StorageRoot

# Every line plotly drew, with the legend group (rank) and name of its trace.
_TRACE_PATHS = """() => Array.from(document.querySelectorAll('g.trace.scatter')).map(g => {
    const trace = g.__data__[0].trace;
    const path = g.querySelector('path.js-line');
    return {rank: trace.legendgroup, name: trace.name, d: path ? path.getAttribute('d') : ''};
})"""
# How many different colours a PNG has, decoded by the browser's canvas.
_COLOURS = """async (png) => {
    const img = new Image();
    img.src = 'data:image/png;base64,' + png;
    await img.decode();
    const canvas = document.createElement('canvas');
    canvas.width = img.width;
    canvas.height = img.height;
    const ctx = canvas.getContext('2d');
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, img.width, img.height).data;
    const seen = new Set();
    for (let i = 0; i < px.length; i += 4) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
    return seen.size;
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank job's report (rank 0 with 2 GPUs), written through the Python API."""
    directory = tmp_path_factory.mktemp("report")
    root = StorageRoot(directory / "storage")
    write_job(root, time.time())
    return write_report(get_job(JOB, storage_root=root.url).metrics(), directory / "report.html")


@pytest.fixture
def page(browser: Browser, report: Path) -> Iterator[tuple[Page, list[str]]]:
    """The report, loaded from its file with every other request refused (and noted)."""
    refused: list[str] = []

    def offline(route: Route) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.route("**/*", offline)
    page.goto(report.as_uri(), wait_until="load")
    try:
        page.wait_for_selector(".main-svg", timeout=10_000)
    except PlaywrightTimeout:
        pytest.fail(f"the report drew no plots; requests refused: {refused or 'none'}")
    yield page, refused
    page.close()


def test_the_report_draws_every_rank_without_the_network(page):
    page, refused = page
    assert page.locator(".main-svg").count() > 0
    assert refused == []  # nothing was asked of the network

    lines = page.evaluate(_TRACE_PATHS)
    drawn = {(t["rank"], t["name"]) for t in lines if t["d"] and t["d"].startswith("M")}
    for rank in ("rank 0", "rank 1"):
        for name in ("CPU cores", "memory", "memory request", "sent"):
            assert (rank, name) in drawn, f"{rank}'s {name} line was not drawn"
    assert {("rank 0", "GPU 0 busy"), ("rank 0", "GPU 1 busy")} <= drawn
    assert not any(rank == "rank 1" and name.startswith("GPU") for rank, name in drawn)


def test_the_report_says_whose_plots_they_are(page):
    page, _ = page
    for text in ("rank 0 · gpu-node-a", "rank 1 · cpu-node-b", "CPU cores", "memory (GiB)",
                 "GPU utilisation (%)", "checkpoints waiting to upload"):  # fmt: skip
        assert page.get_by_text(text).first.is_visible(), f"{text!r} is not visible"
    assert page.locator("h1").inner_text() == f"job {JOB} · vision · RUNNING"
    summary = page.locator("table.summary")
    assert summary.is_visible()
    rows = dict(
        (row.locator("th").inner_text(), row.locator("td").inner_text())
        for row in summary.locator("tr").all()
    )
    assert rows["state"] == "RUNNING"
    assert rows["time in RUNNING"].startswith("6 min")
    assert rows["weights, rank 0"].startswith("hf://acme/llama-small: copied from the mirror")
    assert rows["checkpoint uploads"].startswith("1 waiting (2.0 GiB")


def test_the_report_is_not_a_blank_picture(page, browser):
    page, _ = page
    plot = page.locator(".plotly-graph-div")
    png = base64.b64encode(plot.screenshot()).decode()
    blank = browser.new_page()
    try:
        colours = blank.evaluate(_COLOURS, png)
    finally:
        blank.close()
    assert colours > 10, f"the plots' screenshot has {colours} colour(s)"
