"""The dashboard's sweep view in a real headless Chromium, against a real coordinator process (no nodes).

A sweep of digits-mlp (3 trials, 2 at a time, ASHA by global step) is submitted through the API; its two first trials'
jobs are made running and given progress points straight in the coordinator's SQLite database, as heartbeats would
write them, so that the coordinator's own supervisor prunes the trial behind. The browser signs in with the owner's
token, finds the sweep in the sweeps table, opens it, and watches the page follow without a reload: the trials table
marks the pruned trial, the scatter has one point per trial with a value, and the learning-curve chart one line per
trial with the points written. The sweep's name is hostile markup, shown as text. Screenshots go to
test-artifacts/dashboard/.

Chromium, chromedriver and the skip rules (GPUSWARM_REQUIRE_BROWSER) are test_dashboard.py's.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import test_dashboard
from localswarm import LocalSwarm
from test_dashboard import HOSTILE_NAME, console_errors, screenshot, wait_until

pytestmark = pytest.mark.integration
browser = test_dashboard.browser  # the fixture: headless Chromium, skipped without it, a screenshot on failure
# test_sweep_api's sweep. Its trials' jobs stay pending (no nodes), until the test makes two of them running.
SPACE = {"learning_rate": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
         "hidden": {"type": "int", "low": 16, "high": 256, "log": True},
         "batch_size": {"type": "categorical", "choices": [16, 32, 64]}}
SWEEP = {"name": HOSTILE_NAME, "trials": 3, "parallel": 2, "space": SPACE,
         "pruner": {"kind": "asha", "unit": "step", "min_resource": 1},
         "job": {"workload": "digits-mlp", "budget": 2.0, "hyperparameters": {"target_batch_size": 64}}}
# Trial 0 ahead, trial 1 behind: ASHA (reduction factor 3) keeps the best third at its first rung, so trial 1 is
# pruned at its last step, 2, with its last value, and a third trial starts in its place.
CURVES = {0: [(1, 0.5), (2, 0.7), (3, 0.9)], 1: [(1, 0.1), (2, 0.15)]}
WAIT = 30.0  # seconds: a bound on waiting for the coordinator and the page, not a performance claim


@pytest.fixture
def lab(swarm_lab) -> LocalSwarm:
    # The trial jobs run without escrow here (made running by hand): their books must not close while the test looks.
    swarm = swarm_lab(settle_grace=600.0)
    swarm.start_coordinator()
    return swarm


def write_progress(database: Path, job_ids: list[str]) -> None:
    """Make the trials' jobs running and add their progress points in one transaction, so that the supervisor sees
    both trials' points at the same tick (trial 1 is then measured against trial 0's, whatever the timing)."""
    with sqlite3.connect(database, timeout=30) as db:  # the database is in WAL mode: the coordinator keeps serving
        db.execute("PRAGMA busy_timeout=30000")
        db.executemany("UPDATE jobs SET state = 'running' WHERE id = ?", [(job_id,) for job_id in job_ids])
        db.executemany(
            "INSERT INTO job_progress (job_id, at, epoch, global_step, loss, accuracy, samples_per_second, peers)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(job_ids[number], time.time(), step / 10, step, 1.0 - value, value, 100.0, 1)
             for number, curve in CURVES.items() for step, value in curve])
    db.close()


def sweep_chart(driver, key: str) -> dict:
    """The chart data-chart=key as the page holds it, read in one go: its uPlot's data columns and legend labels,
    the count the page wrote beside it, its canvases and its empty-chart note."""
    return driver.execute_script("""
        const box = document.querySelector(`[data-chart="${arguments[0]}"]`);
        const plot = window.gpuswarmDashboard.chart(arguments[0]);
        return {
            data: plot ? plot.data.map((column) => Array.from(column, (v) => (v === undefined ? null : v))) : [],
            counted: Number(box.dataset.points),
            canvases: box.querySelectorAll(".uplot canvas").length,
            empty: !box.querySelector(".chart-empty").hidden,
            legend: plot ? Array.from(box.querySelectorAll(".u-legend .u-label"), (l) => l.textContent) : [],
        };""", key)


def hover(driver, key: str, x: float) -> list[str]:
    """Move the mouse over chart `key` at x value `x` (mid-height) and return its legend's values."""
    from selenium.webdriver.common.action_chains import ActionChains

    over = driver.find_element("css selector", f'[data-chart="{key}"] .u-over')
    offset = driver.execute_script("""
        const plot = window.gpuswarmDashboard.chart(arguments[0]);
        return plot.valToPos(arguments[1], "x") - plot.over.clientWidth / 2;""", key, x)
    ActionChains(driver).move_to_element_with_offset(over, round(offset), 0).perform()
    return [v.text for v in driver.find_elements("css selector", f'[data-chart="{key}"] .u-legend .u-value')]


def cells(driver, row_selector: str) -> list[str]:
    return [td.text for td in driver.find_elements("css selector", f"{row_selector} td")]


def test_sweep_view_shows_trials_pruning_and_curves(browser, lab: LocalSwarm, artifacts_dir: Path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    screenshots = artifacts_dir / "dashboard"
    sweep = lab.client.submit_sweep(SWEEP)
    lab.wait(lambda: len(lab.client.sweep(sweep.id).trials) == 2, WAIT, "two trials to start")
    job_ids = [t.job_id for t in lab.client.sweep(sweep.id).trials]

    # Sign in; the sweeps table lists the sweep: running, none of its 3 trials done yet.
    browser.get(lab.url + "/dashboard?interval=0.5")
    browser.find_element(By.ID, "token-input").send_keys(lab.client.token)
    browser.find_element(By.CSS_SELECTOR, "#signin button[type=submit]").click()
    row = f'#sweeps-table tr[data-sweep-id="{sweep.id}"]'
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), "the sweep's row", WAIT)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#sweeps-table tbody tr")) == 1
    wait_until(browser, lambda d: cells(d, row)[2:5] == ["running", "accuracy (maximize)", "0 / 3"],
               "the sweep running with 0 of 3 trials done", WAIT)
    # The hostile name is text, in the sweeps table and in its trials' job names: no <img> made of it, no alert.
    assert cells(browser, row)[1] == HOSTILE_NAME
    wait_until(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs-table tbody tr")) == 2, "2 trial jobs",
               WAIT)
    assert {r.find_elements(By.TAG_NAME, "td")[1].text for r in browser.find_elements(
        By.CSS_SELECTOR, "#jobs-table tbody tr")} == {f"{HOSTILE_NAME} trial 0", f"{HOSTILE_NAME} trial 1"}
    assert browser.find_elements(By.CSS_SELECTOR, "main img") == []

    # Open the sweep from its row (a hash route, no reload): two running trials, nothing to draw yet.
    browser.execute_script("window.__noReload = 'still here'")
    browser.find_element(By.CSS_SELECTOR, row).click()
    wait_until(browser, lambda d: d.current_url.endswith(f"#/sweeps/{sweep.id}"), "the sweep's route", WAIT)
    wait_until(browser, lambda d: d.find_element(By.ID, "sweep-name").text == HOSTILE_NAME, "the sweep page", WAIT)
    trial = '#trials-table tr[data-trial="{}"]'.format
    wait_until(browser, lambda d: [cells(d, trial(n))[2] if d.find_elements(By.CSS_SELECTOR, trial(n)) else None
                                   for n in (0, 1)] == ["running", "running"], "two running trials", WAIT)
    assert browser.title.startswith(HOSTILE_NAME)
    for key in ("sweep-trials", "sweep-curves"):
        chart = sweep_chart(browser, key)
        assert chart["counted"] == 0 and chart["empty"], (key, chart)

    # The trials report progress; the coordinator's supervisor prunes trial 1 and starts trial 2, and the page
    # follows.
    write_progress(lab.root / "coordinator" / "coordinator.db", job_ids)
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, trial(2)), "a third trial", WAIT)
    wait_until(browser, lambda d: cells(d, trial(1))[2] == "pruned", "trial 1 pruned", WAIT)
    pruned = browser.find_element(By.CSS_SELECTOR, f"{trial(1)} td:nth-child(3)")
    assert pruned.get_attribute("data-state") == "pruned"
    assert cells(browser, trial(1))[3:5] == ["0.15", "2"]  # its value at its last step, the step it stopped at
    assert cells(browser, trial(0))[2:5] == ["running", "0.9", "–"]
    assert cells(browser, trial(2))[2:5] == ["running", "–", "–"]
    assert [cells(browser, trial(n))[6] for n in range(3)] == [*job_ids, lab.client.sweep(sweep.id).trials[2].job_id]
    assert lab.client.job(job_ids[1]).state == "cancelled"
    assert browser.execute_script("return window.__noReload") == "still here"

    # The scatter: one point per trial with a value (trial 2 has none yet), each in its kind's series.
    wait_until(browser, lambda d: sweep_chart(d, "sweep-trials")["counted"] == 2, "two trials in the scatter", WAIT)
    scatter = sweep_chart(browser, "sweep-trials")
    assert scatter["legend"] == ["trial", "complete", "running", "pruned", "failed", "best"], scatter
    xs, complete, running, pruned_series, failed, best = scatter["data"]
    assert xs == [0, 1] and running == [0.9, None] and pruned_series == [None, 0.15], scatter
    assert complete == failed == best == [None, None], scatter
    assert scatter["canvases"] == 1 and not scatter["empty"], scatter

    # The learning curves: one line per trial with points (trial 2 has none), on the union of their steps.
    wait_until(browser, lambda d: sweep_chart(d, "sweep-curves")["counted"] == 5, "the five points", WAIT)
    curves = sweep_chart(browser, "sweep-curves")
    assert curves["legend"] == ["step", "#0", "#1 (pruned)"], curves
    steps, *lines = curves["data"]
    assert steps == [1, 2, 3], curves
    for number, line in enumerate(lines):
        assert [(s, v) for s, v in zip(steps, line, strict=True) if v is not None] == CURVES[number], curves
    assert curves["canvases"] == 1 and not curves["empty"], curves

    # The legends follow the mouse: a trial's number and values in the scatter, each line's value at a step.
    params = cells(browser, trial(0))[5]
    assert hover(browser, "sweep-trials", 0) == [f"#0 · {params}", "–", "0.9", "–", "–", "–"]
    assert hover(browser, "sweep-curves", 2) == ["2", "0.7", "0.15"]
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "sweep-name")).perform()
    screenshot(browser, screenshots / "sweep.png")

    # Back to the list (a link, no reload): the sweep still runs, one of its trials done.
    browser.find_element(By.LINK_TEXT, "← All sweeps").click()
    wait_until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row) and cells(d, row)[2:5] == [
        "running", "accuracy (maximize)", "1 / 3"], "1 of 3 trials done", WAIT)
    assert cells(browser, row)[5:7] == ["–", "–"]  # no trial completed: no best yet
    assert browser.execute_script("return window.__noReload") == "still here"
    assert browser.find_elements(By.CSS_SELECTOR, "main img") == []
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018
    screenshot(browser, screenshots / "sweeps.png")
    assert console_errors(browser) == []  # no script error, no CSP violation
