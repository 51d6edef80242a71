"""Plotly.js comes from the installed plotly package, under a versioned URL cached for a year."""

from __future__ import annotations

import gzip

import plotly
from django.test import Client

from controlplane.dashboard.vendor import PLOTLY_JS

URL = f"/vendor/plotly-{plotly.__version__}.min.js"


def test_it_serves_plotly_gzipped_with_long_cache_headers(client: Client) -> None:
    response = client.get(URL, HTTP_ACCEPT_ENCODING="gzip, deflate")
    assert response.status_code == 200
    assert response["Content-Encoding"] == "gzip"
    assert response["Cache-Control"] == "public, max-age=31536000, immutable"
    assert response["Content-Type"].startswith("text/javascript")
    assert gzip.decompress(response.content) == PLOTLY_JS.read_bytes()


def test_it_serves_plain_bytes_to_clients_without_gzip(client: Client) -> None:
    response = client.get(URL)
    assert "Content-Encoding" not in response
    assert b"".join(response.streaming_content) == PLOTLY_JS.read_bytes()


def test_it_answers_404_for_another_version(client: Client) -> None:
    assert client.get("/vendor/plotly-0.0.1.min.js").status_code == 404
