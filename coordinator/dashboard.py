"""The dashboard of jobs, sweeps and nodes: a single web page the coordinator serves at /dashboard (and / redirects
there).

Owns the page's routes and the security headers they carry. The page itself is static files shipped in the
package (coordinator/static/: index.html, dashboard.js, dashboard.css; plain JavaScript, no build step) and the
charting library uPlot, vendored unchanged in coordinator/static/vendor/ (its README names the version and hashes;
decision 0027). It reads only the public /v1 API with the owner's token, so it has no privileges of its own and
this module touches no database and no app state.

Only the files named in `FILES` are served: a request cannot walk the package folder. The Content-Security-Policy
allows scripts, styles and requests from this origin only and no inline script, so even a string that slipped
past the page's escaping (everything from the API is set as text, never as HTML) could not run. uPlot needs no
exception to it: it draws on a canvas and sets styles through the CSSOM (element.style), which style-src does not
govern.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

FILES = {  # served name (a path under static/) -> Content-Type
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
PAGE = "index.html"
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a coordinator upgrade must not leave an old script running
}


def _read(name: str) -> bytes:
    # importlib.resources finds the files in a checkout, an editable install and a wheel alike.
    return resources.files("gpuswarm.coordinator").joinpath("static", *name.split("/")).read_bytes()


BODIES = {name: _read(name) for name in (PAGE, *FILES)}  # read once: they ship with the package


async def root(request: web.Request) -> web.Response:
    """/ has nothing else to show: send browsers to the dashboard (relative, so a path prefix in a proxy holds)."""
    raise web.HTTPFound(location="dashboard")


async def page(request: web.Request) -> web.Response:
    return web.Response(body=BODIES[PAGE], content_type="text/html", charset="utf-8", headers=HEADERS)


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in FILES:
        raise web.HTTPNotFound()
    return web.Response(body=BODIES[name], headers=HEADERS | {"Content-Type": FILES[name]})


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/", root)
    app.router.add_get("/dashboard", page)
    # {name} may hold a slash (vendor/...), but only a key of FILES is answered: nothing is looked up on disk.
    app.router.add_get("/dashboard/static/{name:.+}", static_file)
