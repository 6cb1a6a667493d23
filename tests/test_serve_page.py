"""The server's page (GET /) in a real browser: headless Chromium, driven by selenium, against the session's
server (tiny-sd behind a key, warm at 64x64). TPUGEN_SCREENSHOTS=DIR saves the screenshots there as
page-*.png (docs/img holds the README's); by default they go to the test's own tmp directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from serve_support import AUTH, KEY, metric, run_body, wait_run

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 120  # the longest any one wait here may take (an image on XLA:CPU takes about a second)


def test_the_page_is_served_from_the_package_without_the_key_and_its_data_with_it(tmp_path):
    """The page's three files come from the installed package, with no key and while the model loads; the
    endpoint it reads the server from needs the key like every other."""
    from conftest import tiny_config, write_config
    from fastapi.testclient import TestClient

    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.modes.serve.http import build_app
    from tpugen.modes.serve.service import Service

    config = tiny_config(tmp_path)
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())  # loading: no engine yet
    http = TestClient(build_app(service, KEY))
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for needed in ('id="results"', 'id="runs"', 'name="prompt"', 'type="submit"', "/page/page.js", "/page/page.css"):
        assert needed in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere: it works offline
    script = http.get("/page/page.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in script.text and "Retry-After" in script.text
    assert http.get("/page/page.css").status_code == 200
    assert http.get("/page/other.js").status_code == 401  # only the page's own files are open
    assert http.get("/v1/server").status_code == 401
    loading = http.get("/v1/server", headers=AUTH)
    assert loading.status_code == 503 and loading.headers["retry-after"] == "5"


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        missing = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)"
        if os.environ.get("CI") == "true":  # CI installs them: missing there, the browser test fails, never skips
            pytest.fail(missing)
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as ChromeService

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,860"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("TPUGEN_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("page-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def until(driver, condition, what: str, seconds: float = WAIT_S):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, seconds, poll_frequency=0.1).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"not within {seconds} s: {what}") from None


def decoded(driver, selector: str):
    """(naturalWidth, naturalHeight) of the first image `selector` finds, once it has decoded; else None."""
    return driver.execute_script(
        "const img = document.querySelector(arguments[0]);"
        "return img && img.complete && img.naturalWidth ? [img.naturalWidth, img.naturalHeight] : null;",
        selector,
    )


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


@pytest.mark.xla
def test_a_person_makes_an_image_through_the_key_a_busy_server_and_a_bad_field(server, browser, shots):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    url, service = server
    compiles = metric(url, "tpugen_compiles_after_warmup_total")
    browser.get(f"{url}/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    until(browser, lambda d: d.find_element("id", "key-form").is_displayed(), "the page asks for the key")
    browser.find_element("id", "key").send_keys(KEY + Keys.ENTER)
    # The form is filled from the server: its warm size first, its other sizes cold (refused here).
    until(browser, lambda d: Select(d.find_element("id", "size")).options, "the sizes the server keeps warm")
    size = Select(browser.find_element("id", "size"))
    assert size.first_selected_option.get_attribute("value") == "64x64"
    assert all("not warm: refused" in o.text and not o.is_enabled() for o in size.options[1:])
    samplers = {o.get_attribute("value"): o for o in Select(browser.find_element("id", "sampler")).options}
    warm = [name for name, option in samplers.items() if option.is_enabled()]
    assert warm == ["DDIM", "Euler a"] and "the model's own" in samplers["DDIM"].text  # DDIM: tiny-sd's own
    assert all("not warm: refused" in samplers[name].text for name in samplers if name not in warm)
    assert {b.get_attribute("value") for b in browser.find_elements("css selector", '#loras input[name="lora"]')} == {
        "style",
        "subject",
    }
    until(browser, lambda d: "ready" in text(d, "status-state") and "64x64" in text(d, "status-warm"), "the status")
    assert "tiny-sd" in text(browser, "status-model") and "xla" in text(browser, "status-device")

    # A full queue: the page says so and tries again as Retry-After says (2 s), then gets its image.
    Select(browser.find_element("id", "sampler")).select_by_value("Euler a")
    prompt = browser.find_element("name", "prompt")
    prompt.send_keys("a lighthouse at dawn")
    browser.find_element("css selector", '#loras input[value="style"]').click()  # sent as <lora:style:1>
    service.queue.max_requests, limit = 0, service.queue.max_requests
    try:
        prompt.send_keys(Keys.CONTROL + Keys.ENTER)  # Ctrl+Enter submits
        until(browser, lambda d: re.search(r"busy, retrying in \d+ s", text(d, "busy")), "busy, retrying in N s", 10)
    finally:
        service.queue.max_requests = limit
    until(browser, lambda d: decoded(d, "#results img"), "the image in #results")
    assert decoded(browser, "#results img") == [64, 64]
    parameters = text(browser, "results")
    assert "a lighthouse at dawn" in parameters and "Sampler: Euler a" in parameters and "Size: 64x64" in parameters
    assert re.search(r'Lora hashes: "style: [0-9a-f]{12}"', parameters)
    link = browser.find_element("css selector", "#results a.download")
    assert link.get_attribute("download").endswith(".png") and link.get_attribute("href").startswith("data:image/png")
    assert not browser.find_element("id", "busy").is_displayed()
    browser.save_screenshot(str(shots / "page-make.png"))

    # Bad input: the server's own line, beside the field it names.
    steps = browser.find_element("id", "steps")
    steps.clear()
    steps.send_keys("0")
    expected = httpx.post(
        f"{url}/sdapi/v1/txt2img", headers=AUTH, json={"prompt": "a lighthouse at dawn", "steps": 0}, timeout=30
    ).json()["detail"]
    browser.find_element("id", "make").click()
    until(browser, lambda d: text(d, "steps-error"), "the error beside steps")
    assert text(browser, "steps-error").splitlines() == [line for line in expected if line.startswith("steps")]
    assert text(browser, "prompt-error") == ""
    browser.save_screenshot(str(shots / "page-error.png"))
    assert metric(url, "tpugen_compiles_after_warmup_total") == compiles  # all of it on warm shapes


@pytest.mark.xla
def test_a_person_watches_a_run_then_browses_the_runs_its_gallery_and_its_report(server, browser, shots):
    url, service = server
    engine = service.engines[0]
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        # The engine held here: the run waits at its first batch, so the page sees it running, from its events.
        engine.lock.acquire()
        try:
            sent = client.post("/v1/runs", content=run_body("page-run"))
            assert sent.status_code == 201, sent.text
            planned = sent.json()["images_planned"]
            browser.get(f"{url}/#/runs/page-run")
            if browser.execute_script("return !sessionStorage.getItem('tpugen-api-key')"):  # run on its own
                until(browser, lambda d: d.find_element("id", "key-form").is_displayed(), "the page asks for the key")
                browser.find_element("id", "key").send_keys(KEY + "\n")
            until(
                browser,
                lambda d: f"running: 0 of {planned} images" in text(d, "run-progress-text"),
                "the run's progress, from its server-sent events",
            )
        finally:
            engine.lock.release()
        # Its end event: the page reads the run again, its report among it.
        until(browser, lambda d: d.find_elements("id", "report-warmup"), "the report, once the run ended")
        assert wait_run(client, "page-run")["status"] == "complete"
        first = client.get("/v1/runs/page-run/images", params={"limit": 2}).json()
        rest = client.get("/v1/runs/page-run/images", params={"offset": 2, "limit": 2}).json()
        assert (len(first["images"]), first["next"], first["total"]) == (2, 2, planned)
        assert [i["index"] for i in first["images"] + rest["images"]] == list(range(planned)) and rest["next"] is None
        assert httpx.get(f"{url}/v1/runs/page-run/images").status_code == 401
    assert not browser.find_element("id", "run-progress").is_displayed()
    until(browser, lambda d: len(d.find_elements("css selector", "#gallery img")) == planned, "the run's thumbnails")
    thumbs = browser.find_elements("css selector", "#gallery img")
    assert {t.get_attribute("loading") for t in thumbs} == {"lazy"}
    until(browser, lambda d: decoded(d, "#gallery img"), "a thumbnail fetched with the key")
    assert decoded(browser, "#gallery img") == [64, 64]
    facts = text(browser, "report-facts")
    assert "compiles after warmup\n0" in facts and "complete" in facts
    warmup_rows = browser.find_elements("css selector", "#report-warmup tbody tr")
    assert warmup_rows and "64" in warmup_rows[0].text
    assert len(browser.find_elements("css selector", "#report-batches tbody tr")) >= 1
    browser.save_screenshot(str(shots / "page-run.png"))

    browser.find_elements("css selector", "#gallery a")[0].click()
    until(browser, lambda d: d.find_element("id", "viewer").is_displayed(), "the image full size")
    until(browser, lambda d: decoded(d, "#viewer-img"), "the full-size image")
    assert decoded(browser, "#viewer-img") == [64, 64]
    assert "Steps: 3" in text(browser, "viewer-parameters") and "Size: 64x64" in text(browser, "viewer-parameters")
    assert browser.find_element("id", "viewer-download").get_attribute("download").endswith(".png")
    browser.save_screenshot(str(shots / "page-viewer.png"))
    browser.find_element("id", "viewer-close").click()
    until(browser, lambda d: not d.find_element("id", "viewer").is_displayed(), "the viewer closed", 10)

    browser.find_element("id", "nav-runs").click()
    row = until(browser, lambda d: d.find_elements("css selector", '#runs tbody tr[data-run="page-run"]'), "the run")[0]
    assert browser.find_elements("css selector", "#runs tbody tr")[0] == row  # newest first
    assert "complete" in row.text and f"{planned} of {planned}" in row.text
    browser.save_screenshot(str(shots / "page-runs.png"))
    row.find_element("tag name", "a").click()
    until(browser, lambda d: len(d.find_elements("css selector", "#gallery img")) == planned, "the gallery again")
