"""The dashboard's routes without a browser: the real app over real HTTP serves the page, its static files (its own
script and stylesheet, the vendored uPlot's) and the security headers, refuses every other file name, and ships
the files with the package, the vendored ones as their README records them.

The page's behaviour in a browser is tested in tests/integration/test_dashboard.py.
"""

from __future__ import annotations

import glob
import hashlib
import re
import tomllib
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import CoordinatorConfig

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "coordinator" / "static"
SERVED = {  # each file the page names -> its Content-Type
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "vendor/uPlot.iife.min.js": "text/javascript",
    "vendor/uPlot.min.css": "text/css",
}


@pytest.fixture
async def client(tmp_path: Path):
    app = create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", start_dht=False, loop_interval=0.2))
    async with TestServer(app) as server, TestClient(server) as client:
        yield client


def check_security_headers(response) -> None:
    csp = {d.split()[0]: d.split()[1:] for d in response.headers["Content-Security-Policy"].split("; ")}
    assert csp["default-src"] == ["'none'"]
    assert csp["script-src"] == ["'self'"]  # no 'unsafe-inline', no 'unsafe-eval', no other origin
    assert csp["connect-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"]
    assert response.headers["X-Content-Type-Options"] == "nosniff"


async def test_root_redirects_to_the_dashboard(client: TestClient):
    response = await client.get("/", allow_redirects=False)
    assert response.status == 302
    assert response.headers["Location"] == "dashboard"


async def test_page_and_its_static_files_are_served_with_security_headers(client: TestClient):
    response = await client.get("/dashboard")
    assert response.status == 200, await response.text()
    assert response.content_type == "text/html"
    check_security_headers(response)
    html = await response.text()
    assert "<table id=\"nodes-table\">" in html and 'data-chart="accuracy"' in html

    # Every script is a file (the CSP would block inline ones), and every file the page names is served.
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
    assert "style=" not in html
    names = re.findall(r'(?:src|href)="dashboard/static/([^"]+)"', html)
    assert sorted(names) == sorted(SERVED)
    # uPlot first: the page's script uses it, and the page's stylesheet adjusts uPlot's.
    assert names.index("vendor/uPlot.min.css") < names.index("dashboard.css")
    assert names.index("vendor/uPlot.iife.min.js") < names.index("dashboard.js")
    for name in names:
        served = await client.get(f"/dashboard/static/{name}")
        assert served.status == 200, name
        assert served.content_type == SERVED[name]
        assert served.charset == "utf-8"
        check_security_headers(served)
        assert await served.read() == (STATIC / name).read_bytes()


async def test_the_script_never_writes_html(client: TestClient):
    """Job names are user input: the script sets text (textContent, attributes), never markup."""
    script = await (await client.get("/dashboard/static/dashboard.js")).text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in script, sink


@pytest.mark.parametrize("path", [
    "/dashboard/static/index.html",  # the page has its own route; only the listed files are static
    "/dashboard/static/dashboard.py",
    "/dashboard/static/..%2Fdashboard.py",
    "/dashboard/static/%2e%2e%2f%2e%2e%2fapp.py",
    "/dashboard/static/",
    "/dashboard/nothing.js",
    "/dashboard/static/vendor/",
    "/dashboard/static/vendor/README.md",  # shipped beside uPlot, not served
    "/dashboard/static/vendor/uPlot.LICENSE",
    "/dashboard/static/vendor/uPlot.js",
    "/dashboard/static/uPlot.iife.min.js",  # only under the name the page uses
    "/dashboard/static/vendor/..%2Fdashboard.js",
    "/dashboard/static/vendor%2F..%2F..%2Fdashboard.py",
])
async def test_other_files_are_not_served(client: TestClient, path: str):
    response = await client.get(path, allow_redirects=False)
    assert response.status == 404, (path, await response.text())


def test_package_data_ships_every_dashboard_file():
    """An installed wheel has the files: each one in the folder, vendor/ included, matches a package-data pattern
    (expanded with glob, as setuptools does: a "*" does not reach into a subfolder)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["gpuswarm.coordinator.static"] == "coordinator/static"
    assert "gpuswarm.coordinator.static" in config["packages"]
    patterns = config["package-data"]["gpuswarm.coordinator.static"]
    shipped = {Path(f).as_posix() for p in patterns for f in glob.glob(p, root_dir=STATIC)}
    files = sorted(p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*") if p.is_file())
    assert {"index.html", "dashboard.js", "dashboard.css", *SERVED, "vendor/uPlot.LICENSE"} <= set(files)
    assert [f for f in files if f not in shipped] == []


def test_vendored_files_are_the_ones_their_readme_records():
    """vendor/README.md names each vendored file with its sha256: a file edited by hand or half-upgraded fails."""
    readme = (STATIC / "vendor" / "README.md").read_text()
    recorded = dict(re.findall(r"^\| `([^`]+)` \| `[^`]+` \| `([0-9a-f]{64})` \|$", readme, re.M))
    vendored = sorted(p.name for p in (STATIC / "vendor").iterdir() if p.name != "README.md")
    assert sorted(recorded) == vendored
    for name, digest in recorded.items():
        assert hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest() == digest, name
    assert "The MIT License" in (STATIC / "vendor" / "uPlot.LICENSE").read_text()
