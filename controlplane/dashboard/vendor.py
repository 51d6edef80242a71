"""Plotly.js, served from the installed ``plotly`` Python package: no CDN, no node build.

The file is ~4.7 MB (~1.4 MB gzipped). Its URL carries the package version, so browsers may keep
it for a year without asking again; an upgrade of ``plotly`` changes the URL.
"""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path

import plotly
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

PLOTLY_VERSION: str = plotly.__version__
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
_CACHE_FOREVER = "public, max-age=31536000, immutable"


@cache
def _gzipped() -> bytes:
    # Compressed once per process on first use: the file never changes while it runs.
    return gzip.compress(PLOTLY_JS.read_bytes(), compresslevel=6)


@require_safe
def plotly_js(request: HttpRequest, version: str) -> HttpResponse:
    """The bundled plotly.min.js (gzip when the browser takes it), cached for a year."""
    if version != PLOTLY_VERSION:
        raise Http404(f"this server ships plotly {PLOTLY_VERSION}")
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        response: HttpResponse = HttpResponse(_gzipped(), content_type="text/javascript; charset=utf-8")
        response["Content-Encoding"] = "gzip"
    else:
        response = FileResponse(PLOTLY_JS.open("rb"), content_type="text/javascript; charset=utf-8")
    response["Cache-Control"] = _CACHE_FOREVER
    response["Vary"] = "Accept-Encoding"
    return response
