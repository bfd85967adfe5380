"""A screenshot of the dashboard (docs/dashboard.png) on a running server: a few requests
(a code prompt the reply partly copies, a chat) run beside the page, then the page's chat box
asks the first prompt and colours its reply by how each token came.

    mlx-dflash serve --port 8080 &
    python scripts/dashboard_screenshot.py --url http://127.0.0.1:8080 --out docs/dashboard.png

Needs Debian's chromium and chromium-driver, and selenium.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)
'''
PROMPTS = [
    f"Here is a function:\n\n{CODE}\nRewrite it with type hints and a docstring.",
    "Give three tips for writing clear commit messages.",
    "What is the capital of France, and what river runs through it?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]

    def ask(prompt: str, max_tokens: int = 160) -> None:
        httpx.post(f"{args.url}/v1/chat/completions", headers=headers, timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0})

    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1500"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(f"{args.url}/dashboard")
        if args.api_key:
            driver.execute_script("sessionStorage.setItem('mlx-dflash-key', arguments[0])",
                                  args.api_key)
            driver.refresh()
        for prompt in PROMPTS:  # some history for the charts
            ask(prompt)
        background = [threading.Thread(target=ask, args=(p, 400)) for p in PROMPTS[1:]]
        for t in background:
            t.start()
        time.sleep(1.0)
        driver.find_element(By.ID, "chat-input").send_keys(PROMPTS[0])
        driver.find_element(By.ID, "chat-send").click()
        WebDriverWait(driver, 600).until(
            lambda d: d.find_element(By.ID, "chat-reply").get_attribute("data-done") == "true")
        time.sleep(1.5)  # a last poll, while the other requests still run
        height = driver.execute_script("return document.body.scrollHeight") + 20
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # the whole page
            "width": 1280, "height": height, "deviceScaleFactor": 1, "mobile": False})
        driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
        for t in background:
            t.join()
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
