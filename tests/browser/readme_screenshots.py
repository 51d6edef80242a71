"""Capture the README's screenshots (docs/img/overview.png, docs/img/breakdown.png) from a running gorgo.

Start the demo (``make run``), let the traffic run a few minutes, then:

    .venv/bin/python -m tests.browser.readme_screenshots --password <operator password>

Uses Debian's chromium like the browser tests. Not a test: it only takes pictures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
CHARTS = {
    "/": ("overview", ["map", "rtt-matrix", "ttft-series", "rate-series"]),
    "/breakdown/": ("breakdown", ["by-region", "by-node", "ttft-over-time"]),
}


def capture(url: str, username: str, password: str, out: Path, window: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    saved = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1).new_page()
        page.goto(f"{url}/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/")
        for path, (name, charts) in CHARTS.items():
            page.goto(f"{url}{path}" + (f"?window={window}" if path != "/" else ""))
            for chart in charts:
                page.wait_for_function(
                    f"document.getElementById('{chart}').data !== undefined", timeout=20_000
                )
            page.wait_for_function("Gorgo.socketState.state === 'live'", timeout=20_000)
            page.wait_for_timeout(1500)  # let the first live updates land
            target = out / f"{name}.png"
            page.screenshot(path=str(target), full_page=True)
            saved.append(target)
        browser.close()
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--username", default="operator")
    parser.add_argument("--password", required=True)
    parser.add_argument("--window", default="15m", choices=["15m", "1h", "24h"], help="breakdown window")
    parser.add_argument("--out", type=Path, default=DOCS_IMG)
    args = parser.parse_args()
    for path in capture(args.url, args.username, args.password, args.out, args.window):
        print(path)


if __name__ == "__main__":
    main()
