"""The playground page in a real headless browser (Debian's chromium + chromedriver via selenium): load it, send
a message, see streamed text appear and the phase figures and engine state filled in."""
from __future__ import annotations

import os
import re
import shutil

import pytest

pytestmark = pytest.mark.slow   # a real browser (make test-fast skips it)

pytest_plugins = ["tests.server_fixtures"]


def _find(*names: str) -> str | None:
    for n in names:
        path = shutil.which(n) or (n if os.path.isfile(n) else None)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chrome = _find("chromium", "chromium-browser", "google-chrome", "/usr/lib/chromium/chromium")
    driver_path = _find("chromedriver", "/usr/lib/chromium/chromedriver")
    if chrome is None or driver_path is None:
        pytest.skip("no headless browser here: install Debian's `chromium` and `chromium-driver` "
                    "(.ci/run does) to run the playground test")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    from selenium.webdriver.chrome.service import Service
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    yield driver
    driver.quit()


def test_playground_streams_a_reply(browser, live_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(live_server.url + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: "tiny-chat" in d.find_element(By.ID, "model").text)       # /stats answered
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(live_server.api_key)
    browser.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("24")
    browser.find_element(By.ID, "prompt").send_keys("Hello, who are you?")
    # pace the engine: the tiny model could make all 24 tokens before the page reads the first chunk, and a
    # reply that arrives in one piece has no decode time to show
    with live_server.hold(lambda state: 0.005):
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.user"))
        reply = wait.until(lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .text") if e.text])
        assert reply[0].text.strip()                                               # streamed text appeared
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))  # the reply has finished
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    assert browser.find_element(By.ID, "ttft").text.endswith("ms")                # phase 1: time to first token
    assert browser.find_element(By.ID, "tps").text != "–"                         # phase 2: tokens / s
    assert re.fullmatch(r"\d+ → \d+", browser.find_element(By.ID, "tokens").text)  # usage: prompt → reply
    assert "/" in browser.find_element(By.ID, "kv").text                          # engine state, live
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline .tick")
