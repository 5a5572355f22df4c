"""Open a report in headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium)
and say what a person would see: console errors, rendered plots, loaded images and audio."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def need_browser() -> None:
    """Skip without a browser, except under CI (`.ci/run` installs one): there it must run."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but Chromium/ChromeDriver are missing: .ci/run installs them with apt")
        pytest.skip("no Chromium here (apt-get install chromium chromium-driver)")


def inspect_page(html: Path, screenshot: Path, settle_s: float = 20.0) -> dict:
    """Load `html` from disk; wait until every plot div has rendered and every image and audio element
    has loaded (or `settle_s` passed); return counts, console errors and the screenshot's path."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,2000", "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(Path(html).resolve().as_uri())
        script = """return {
          plots: document.querySelectorAll('div.plot div.plotly-graph-div').length,
          rendered: document.querySelectorAll('div.plot .js-plotly-plot .main-svg').length > 0 ?
                    document.querySelectorAll('div.plot .js-plotly-plot').length : 0,
          images: document.images.length,
          images_loaded: Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length,
          audio: document.querySelectorAll('audio').length,
          audio_loaded: Array.from(document.querySelectorAll('audio')).filter(a => a.readyState >= 1 && a.duration > 0).length
        };"""
        deadline = time.monotonic() + settle_s
        while True:
            seen = driver.execute_script(script)
            done = (seen["rendered"] == seen["plots"] and seen["images_loaded"] == seen["images"]
                    and seen["audio_loaded"] == seen["audio"])
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        driver.save_screenshot(str(screenshot))
        seen["errors"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        seen["screenshot"] = str(screenshot)
        return seen
    finally:
        driver.quit()
