"""The dashboard in a real headless Chromium, against a real coordinator and two node daemons training digits-mlp.

The browser signs in with the owner's token, finds the jobs, opens one and watches its accuracy curve (a uPlot
chart, read through its data) grow without a reload, reads one node row per registered node, shows a hostile job
name as text, reports a refused token, and puts up its error banner once the coordinator is gone. Screenshots go to
test-artifacts/dashboard/.

Chromium and chromedriver come from the system (Debian: `apt-get install chromium chromium-driver`). Without them
the test skips with the reason, unless GPUSWARM_REQUIRE_BROWSER=1 (CI), which makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.node.identity import Identity
from localswarm import LocalSwarm

pytestmark = pytest.mark.integration
REQUIRE_ENV = "GPUSWARM_REQUIRE_BROWSER"
BROWSER_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--window-size=1440,1000"]
# test_local_swarm's digits job on two nodes. Its target is out of reach and it has no epoch limit, so it is still
# training (and the curve still growing) whenever the browser looks: local updates take a digits-mlp swarm through
# 60 epochs in a few seconds, which ended the job under max_epochs 60 before the browser saw its curve grow.
SPEC = {"name": "dashboard-digits", "workload": "digits-mlp", "min_nodes": 2, "max_nodes": 2, "budget": 5.0,
        "stop": {"target_accuracy": 1.0, "max_epochs": None, "max_seconds": 3600}}
HOSTILE_NAME = "<img src=x onerror=alert(1)>"
MANY_NODES = 120
GPUS = [("NVIDIA RTX 4090", 24.0, 1), ("NVIDIA A100-SXM4-80GB", 80.0, 8), ("NVIDIA H100 80GB HBM3", 80.0, 4), None]
WAIT = 180.0  # seconds: a bound on waiting for the swarm and the page (2 shared cores), not a performance claim


def browser_paths() -> tuple[str, str]:
    """Chromium and chromedriver, or a skip (a failure under GPUSWARM_REQUIRE_BROWSER) naming what is missing."""
    problems = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        problems.append("the selenium package (pip install -e '.[dev]')")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None:
        problems.append("a chromium binary (apt-get install chromium)")
    if driver is None:
        problems.append("chromedriver (apt-get install chromium-driver)")
    if problems:
        reason = "the browser test needs " + ", ".join(problems)
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set, but {reason}", pytrace=False)
        pytest.skip(f"{reason}; set {REQUIRE_ENV}=1 to make this an error")
    return browser, driver


def headless_chromium(browser: str, driver: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in BROWSER_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors: CSP violations, JS errors
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture
def browser(artifacts_dir: Path, request) -> Iterator:
    paths = browser_paths()
    driver = headless_chromium(*paths)
    try:
        yield driver
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            out = artifacts_dir / "dashboard"
            out.mkdir(exist_ok=True)
            try:
                driver.save_screenshot(str(out / f"{request.node.name}-failure.png"))
                (out / f"{request.node.name}-failure.html").write_text(driver.page_source)
            except Exception:  # an alert still open, a crashed browser: the swarm logs remain
                pass
        driver.quit()


@pytest.fixture
def swarm(swarm_lab) -> LocalSwarm:
    lab = swarm_lab()
    lab.start_coordinator()
    for i in range(2):
        lab.start_node(i, price=0.5 + 0.1 * i)
    lab.wait_for_nodes(2)
    return lab


def wait_until(driver, condition, what: str, timeout: float = WAIT):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.25).until(lambda d: condition(d), message=what)


def chart_state(driver, name: str) -> dict:
    """The chart data-chart=name as the page holds it, read in one go (a poll may redraw it between two reads):
    the points in its uPlot's data, the count the page wrote beside it, its canvases and its "no data yet"."""
    return driver.execute_script("""
        const box = document.querySelector(`[data-chart="${arguments[0]}"]`);
        const plot = window.gpuswarmDashboard.chart(arguments[0]);
        return {
            points: plot ? plot.data[1].filter(Number.isFinite).length : 0,
            xs: plot ? plot.data[0].length : 0,
            counted: Number(box.dataset.points),
            canvases: box.querySelectorAll(".uplot canvas").length,
            empty: !box.querySelector(".chart-empty").hidden,
            legend: plot ? Array.from(box.querySelectorAll(".u-legend .u-label"), (l) => l.textContent) : [],
        };""", name)


def chart_points(driver, name: str) -> int:
    return chart_state(driver, name)["points"]


def screenshot(driver, path: Path) -> None:
    """The whole page: the viewport is stretched to the document's height (headless windows stop at the screen)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1440, "height": max(900, min(int(height), 4000)), "deviceScaleFactor": 1, "mobile": False})
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_dashboard_shows_jobs_nodes_and_live_curves(swarm: LocalSwarm, browser, artifacts_dir: Path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    screenshots = artifacts_dir / "dashboard"
    hostile = swarm.client.submit_job(SPEC | {"name": HOSTILE_NAME, "min_nodes": 3, "max_nodes": 3})  # stays pending
    job = swarm.client.submit_job(SPEC)
    node_ids = {swarm.node_id(i) for i in range(2)}

    # / sends the browser to the page; ?interval=0.5 polls every half second.
    browser.get(swarm.url + "/")
    assert browser.current_url == swarm.url + "/dashboard"
    browser.get(swarm.url + "/dashboard?interval=0.5")

    # The nodes table is public: one row per registered node, before anyone signs in.
    wait_until(browser, lambda d: {r.get_attribute("data-node-id") for r in d.find_elements(
        By.CSS_SELECTOR, "#nodes-table tbody tr")} == node_ids, "one node row per registered node")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#nodes-table tbody tr")) == 2
    assert browser.find_element(By.ID, "nodes-summary").text.startswith("2 registered · 2 online")

    # Sign in with the owner token; the page keeps it and lists the owner's jobs.
    assert browser.find_element(By.ID, "signin").is_displayed()
    browser.find_element(By.ID, "token-input").send_keys(swarm.client.token)
    browser.find_element(By.CSS_SELECTOR, "#signin button[type=submit]").click()
    wait_until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-table tbody tr")) == 2, "both jobs")
    assert browser.execute_script("return localStorage.getItem('gpuswarm.ownerToken')") == swarm.client.token
    assert "swarm-owner" in browser.find_element(By.ID, "owner").text

    # The hostile name is text: the same characters on screen, no <img> made from it, no alert.
    name_cell = browser.find_element(By.CSS_SELECTOR, f'tr[data-job-id="{hostile.id}"] td:nth-child(2)')
    assert name_cell.text == HOSTILE_NAME
    assert browser.find_elements(By.CSS_SELECTOR, "#jobs-table img") == []
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018

    # The training job's row goes to "running" in place, and every node row names it as the node's job.
    row = f'tr[data-job-id="{job.id}"]'
    wait_until(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} td:nth-child(3)").text == "running",
               "the job to run")
    wait_until(browser, lambda d: all(job.id in r.text for r in d.find_elements(
        By.CSS_SELECTOR, "#nodes-table tbody tr")), "the nodes to show their job")

    # Open the job from its row: the hash route, the same page, no reload (the marker survives).
    browser.execute_script("window.__noReload = 'still here'")
    browser.find_element(By.CSS_SELECTOR, row).click()
    wait_until(browser, lambda d: d.current_url.endswith(f"#/jobs/{job.id}"), "the job's route")
    wait_until(browser, lambda d: d.find_element(By.ID, "job-name").text == SPEC["name"], "the job page")
    wait_until(browser, lambda d: chart_points(d, "accuracy") >= 2, "two accuracy points")
    seen = chart_points(browser, "accuracy")
    wait_until(browser, lambda d: chart_points(d, "accuracy") > seen, "the accuracy curve to grow")
    assert browser.execute_script("return window.__noReload") == "still here"

    for name, label in (("loss", "loss"), ("accuracy", "accuracy"), ("samples_per_second", "samples/s")):
        chart = chart_state(browser, name)  # one uPlot canvas, its data the points the page counted
        assert chart["points"] >= 1 and chart["points"] == chart["xs"] == chart["counted"], (name, chart)
        assert chart["canvases"] == 1 and not chart["empty"], (name, chart)
        assert chart["legend"] == ["time", label], (name, chart)
    wait_until(browser, lambda d: {r.get_attribute("data-node-id") for r in d.find_elements(
        By.CSS_SELECTOR, "#members-table tbody tr")} == node_ids, "both members in the job's node table")
    assert any("assigned node" in e.text for e in browser.find_elements(By.CSS_SELECTOR, "#events li"))
    screenshot(browser, screenshots / "job.png")

    # Back to the list (a link, still no reload): the job's row now carries its accuracy.
    browser.find_element(By.LINK_TEXT, "← All jobs").click()
    wait_until(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} td:nth-child(5)").text.endswith("%"),
               "the job's accuracy in the list")
    assert browser.execute_script("return window.__noReload") == "still here"
    screenshot(browser, screenshots / "overview.png")
    assert console_errors(browser) == []  # no script error, no CSP violation

    # The hostile job's own page: the heading and the tab title show the name as text too.
    browser.get(f"{swarm.url}/dashboard?interval=0.5#/jobs/{hostile.id}")
    wait_until(browser, lambda d: d.find_element(By.ID, "job-name").text == HOSTILE_NAME, "the hostile job's page")
    assert browser.title.startswith(HOSTILE_NAME)
    assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
    # It never ran: each chart says so.
    for name in ("loss", "accuracy", "samples_per_second"):
        chart = chart_state(browser, name)
        assert chart["points"] == chart["counted"] == 0 and chart["empty"], (name, chart)
        assert browser.find_element(By.CSS_SELECTOR, f'[data-chart="{name}"] .chart-empty').text == "no data yet"

    # A refused token is a clear message, not an empty list.
    browser.get(f"{swarm.url}/dashboard?interval=0.5#/")
    browser.find_element(By.ID, "signout").click()
    assert browser.execute_script("return localStorage.getItem('gpuswarm.ownerToken')") is None
    browser.find_element(By.ID, "token-input").send_keys("gso_not-a-token")
    browser.find_element(By.CSS_SELECTOR, "#signin button[type=submit]").click()
    wait_until(browser, lambda d: "401" in d.find_element(By.ID, "auth-message").text, "the 401 message")
    assert not browser.find_element(By.ID, "jobs-wrap").is_displayed()

    # The coordinator goes away: the page says so, and keeps what it showed.
    os.killpg(swarm.coordinator.pid, signal.SIGTERM)
    swarm.coordinator.wait(timeout=60)
    wait_until(browser, lambda d: d.find_element(By.ID, "error-banner").is_displayed(), "the error banner")
    assert "Cannot reach the coordinator" in browser.find_element(By.ID, "error-banner").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#nodes-table tbody tr")) == 2
    screenshot(browser, screenshots / "unreachable.png")


def register_node(lab: LocalSwarm, index: int) -> str:
    """A real signed registration, as a daemon sends it (this node then stays silent and goes offline)."""
    identity = Identity(Ed25519PrivateKey.generate())
    gpu = GPUS[index % len(GPUS)]
    resources = {"cpu_cores": 16, "ram_gb": 64.0,
                 "gpus": [] if gpu is None else [{"model": gpu[0], "memory_gb": gpu[1], "count": gpu[2]}]}
    registration = {"node_id": identity.node_id, "resources": resources, "software_version": "test",
                    "price_per_gpu_hour": round(0.2 + 0.01 * index, 2)}
    lab.client.request("POST", "/v1/nodes/register", identity.sign("register", registration).model_dump(mode="json"))
    return identity.node_id


def test_node_table_stays_readable_with_many_nodes(tmp_path, browser, artifacts_dir: Path):
    from selenium.webdriver.common.by import By

    with LocalSwarm(tmp_path / "swarm") as lab:
        lab.start_coordinator()
        node_ids = [register_node(lab, i) for i in range(MANY_NODES)]
        browser.get(lab.url + "/dashboard?interval=0.5")
        rows = "#nodes-table tbody tr"
        wait_until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == MANY_NODES, "every node row")
        assert {r.get_attribute("data-node-id") for r in browser.find_elements(By.CSS_SELECTOR, rows)} == set(node_ids)
        assert browser.find_element(By.ID, "nodes-summary").text.startswith(f"{MANY_NODES} registered")
        assert "8× NVIDIA A100-SXM4-80GB 80 GB" in browser.find_element(By.ID, "nodes-table").text

        # The table scrolls inside its card, and its header stays on top of the rows while it does.
        box = browser.find_element(By.CSS_SELECTOR, "#nodes-card .scroll")
        assert browser.execute_script("return arguments[0].scrollHeight > 2 * arguments[0].clientHeight", box)
        browser.execute_script("arguments[0].scrollTop = arguments[0].scrollHeight", box)
        header, last = browser.execute_script(
            "const top = arguments[0].getBoundingClientRect().top;"
            "return [arguments[0].querySelector('th').getBoundingClientRect().top - top,"
            "        arguments[0].querySelector('tbody tr:last-child').getBoundingClientRect().bottom"
            "        - arguments[0].getBoundingClientRect().bottom];", box)
        assert abs(header) <= 2 and abs(last) <= 2, (header, last)
        screenshot(browser, artifacts_dir / "dashboard" / "many-nodes.png")

        # The filter narrows the rows to one node.
        browser.find_element(By.ID, "nodes-filter").send_keys(node_ids[77])
        visible = [r for r in browser.find_elements(By.CSS_SELECTOR, rows) if r.is_displayed()]
        assert [r.get_attribute("data-node-id") for r in visible] == [node_ids[77]]
        assert console_errors(browser) == []
