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


def _ready(browser, live_server, max_tokens: int, prompt: str):
    """Once /stats has answered: the API key and max tokens filled in, the prompt typed. Returns the wait."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: "tiny-chat" in d.find_element(By.ID, "model").text)       # /stats answered
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(live_server.api_key)
    browser.execute_script("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys(str(max_tokens))
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    return wait


def test_playground_streams_a_reply(browser, live_server):
    from selenium.webdriver.common.by import By

    browser.get(live_server.url + "/")
    wait = _ready(browser, live_server, 24, "Hello, who are you?")
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


def test_markdown_history_regenerate_and_thinking(browser, live_server):
    """Replies render markdown (escaped first: no HTML of the model's gets through); a new chat starts empty and
    the old one comes back from the history; the last reply regenerates in place; thinking shows folded."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(live_server.url + "/")
    browser.execute_script("localStorage.removeItem('tokenmill-chats'); location.reload()")
    wait = _ready(browser, live_server, 6, "First chat")
    html = browser.execute_script(
        "return renderMarkdown('**b** and `c`\\n\\n- x\\n- y\\n\\n```\\n<i>raw</i>\\n```\\n<img src=x onerror=1>')")
    assert "<strong>b</strong> and <code>c</code>" in html and "<ul><li>x</li><li>y</li></ul>" in html
    assert "<pre><code>&lt;i&gt;raw&lt;/i&gt;</code></pre>" in html and "<img" not in html

    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    # the reply went through the markdown renderer: its text sits in block elements, not bare
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .text > *")
    first_stats = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text

    # regenerate: the last reply is replaced, not added to
    browser.find_element(By.CSS_SELECTOR, ".msg.assistant .regen").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 1
               and d.find_elements(By.CSS_SELECTOR, ".msg.assistant .regen"))
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1 and first_stats

    # a new chat starts empty; the first comes back from the history, with its messages
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    history = Select(browser.find_element(By.ID, "history"))
    assert [o.text for o in history.options] == ["New chat", "First chat"]
    history.select_by_visible_text("First chat")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user .text").text == "First chat"

    # thinking (what --reasoning-parser splits out) is shown folded above the answer
    browser.execute_script("showMessage({role: 'assistant', content: 'The answer.', reasoning: 'Let me think.'})")
    think = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant details.thinking")[-1]
    assert think.is_displayed() and think.get_attribute("open") is None
    assert think.find_element(By.TAG_NAME, "summary").text == "Thinking"
    think.find_element(By.TAG_NAME, "summary").click()
    assert think.find_element(By.CSS_SELECTOR, ".think-text").text == "Let me think."
