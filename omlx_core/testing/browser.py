"""A headless Chromium for tests and screenshots of the dashboard: Debian's ``chromium``
driven through its ``chromedriver`` by Selenium (``./setup.sh test`` installs all three)."""

from __future__ import annotations

import os
import shutil
from typing import Any

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"


class BrowserMissing(RuntimeError):
    """Chromium, chromedriver or selenium is not installed."""


def headless_chromium(width: int = 1400, height: int = 1800) -> Any:
    """A started headless Chromium (a ``selenium.webdriver.Chrome``) that keeps its console
    log for :func:`console_errors`; quit it when done."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        raise BrowserMissing(f"selenium is not installed ({exc}): pip install "
                             "'omlx-core[test]' or run ./setup.sh test") from None
    browser, driver = shutil.which(CHROMIUM), shutil.which(CHROMEDRIVER)
    if browser is None or driver is None:
        raise BrowserMissing("chromium and chromedriver are not both on PATH: apt-get install "
                             "chromium chromium-driver (./setup.sh test does)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Chromium's renderer dies with the OpenBLAS that omlx-core preloads into itself.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return webdriver.Chrome(options=options, service=Service(driver, env=env))


def console_errors(driver: Any) -> list[str]:
    """The console entries of level SEVERE since the last call (errors, failed loads)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
