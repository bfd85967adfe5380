"""The dashboard in a real browser (Debian's chromium, driven by Selenium): it loads with no
console errors, shows the served model, streams a chat equal to the API's reply, shows markup
in a reply as text, updates its charts while requests run, and asks for the API key."""

import json
import shutil
import threading

import httpx
import pytest
from test_server import TEMPLATE
from tiny import make_drafter, make_target

from mlx_dflash.server import BackgroundServer, create_app

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver")

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

NAME = "tiny-markup"
V = 64
PROMPT = "w5 w6 w7"


def markup_tokenizer():
    """Words w1..w9 for prompts; every other token is markup that would run if rendered."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>"] + [f"w{i}" for i in range(1, 10)]
    while len(words) < V:
        i = len(words)
        words.append(f"<script>window.pwned={i}</script>" if i % 2
                     else f'<img src=x onerror="window.pwned={i}">')
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    hf.chat_template = TEMPLATE
    return TokenizerWrapper(hf, eos_token_ids=[0])


@pytest.fixture(scope="module")
def pair():
    model = make_target("qwen3", vocab_size=V, seed=3)
    return model, make_drafter(model, block_size=4), markup_tokenizer()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1500"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def errors(driver, allow=()):
    return [e for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def wait(driver, condition, timeout=30):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))


def text_of(driver, css):
    return driver.find_element(By.CSS_SELECTOR, css).get_attribute("textContent")


def api_reply(server, max_tokens):
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body,
                      timeout=60).json()["choices"][0]["message"]["content"]


def chat(driver, prompt, max_tokens):
    box = driver.find_element(By.ID, "chat-max")
    box.clear()
    box.send_keys(str(max_tokens))
    driver.find_element(By.ID, "chat-input").send_keys(prompt)
    driver.find_element(By.ID, "chat-send").click()
    wait(driver, lambda d: d.find_element(By.ID, "chat-reply").get_attribute("data-done")
         == "true")


def test_the_page_shows_the_model_and_streams_a_chat_as_the_api_answers(pair, browser):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        browser.get(f"{server.url}/dashboard")
        wait(browser, lambda d: NAME in text_of(d, "#models tbody"))
        assert "DFlashDraftModel" in text_of(browser, "#models tbody")
        chat(browser, PROMPT, 24)
        shown = text_of(browser, "#chat-reply")
        assert shown == api_reply(server, 24)
        # The reply is markup; it shows as text: no element made from it, no script run.
        assert "<script>" in shown and "onerror" in shown
        assert browser.find_elements(By.CSS_SELECTOR, "#chat-reply img, #chat-reply script") == []
        assert browser.execute_script("return window.pwned === undefined")
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018
        spans = browser.find_elements(By.CSS_SELECTOR, "#chat-reply span")
        origins = {s.get_attribute("class") for s in spans}
        assert "o-target" in origins and origins <= {"o-target", "o-drafter", "o-copy",
                                                     "o-ngram", "o-tree", "o-forced"}
        assert "tokens/s" in text_of(browser, "#chat-stats")
        assert errors(browser) == []


def test_the_charts_and_requests_move_while_requests_run(pair, browser):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        browser.get(f"{server.url}/dashboard")
        wait(browser, lambda d: NAME in text_of(d, "#models tbody"))
        stop = threading.Event()

        def load():
            while not stop.is_set():
                api_reply(server, 40)

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait(browser, lambda d: "running" in text_of(d, "#requests tbody"))
            wait(browser, lambda d: int(d.find_element(By.ID, "chart-rate")
                                        .get_attribute("data-points") or 0) >= 3)
            rate = float(text_of(browser, "#rate-now") or 0)
            points = browser.find_element(By.CSS_SELECTOR, "#chart-rate polyline")
            assert rate > 0 and len(points.get_attribute("points").split()) >= 3
        finally:
            stop.set()
            for t in threads:
                t.join()
        stats = httpx.get(f"{server.url}/v1/stats").json()
        assert stats["history"][-1][1] > 0  # tokens committed, as the chart read them
        assert errors(browser) == []


def test_with_a_key_the_page_asks_for_it(pair, browser):
    app = create_app(*pair, model_name=NAME, api_key="sesame")
    with BackgroundServer(app) as server:
        browser.get(f"{server.url}/dashboard")
        form = browser.find_element(By.ID, "key-form")
        wait(browser, lambda d: form.is_displayed())
        assert NAME not in text_of(browser, "#models tbody")
        browser.find_element(By.ID, "key").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait(browser, lambda d: "refused" in text_of(d, "#key-error"))
        key = browser.find_element(By.ID, "key")
        key.clear()
        key.send_keys("sesame")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait(browser, lambda d: NAME in text_of(d, "#models tbody"))
        assert not form.is_displayed()
        chat(browser, PROMPT, 8)
        assert text_of(browser, "#chat-reply") == httpx.post(
            f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer sesame"},
            json={"model": NAME, "messages": [{"role": "user", "content": PROMPT}],
                  "max_tokens": 8, "temperature": 0}).json()["choices"][0]["message"]["content"]
        # Only the refused key's requests failed (the browser logs each 401).
        assert errors(browser, allow=("401",)) == []
        browser.execute_script("sessionStorage.clear()")


def test_stats_json_has_what_the_page_reads(pair):
    with BackgroundServer(create_app(*pair, model_name=NAME)) as server:
        api_reply(server, 4)
        stats = httpx.get(f"{server.url}/v1/stats").json()
        for key in ("version", "uptime_s", "models", "requests", "history", "memory",
                    "kernels", "totals", "running", "waiting"):
            assert key in stats, key
        json.dumps(stats)
