"""The live page (`/`) and the API docs (`/docs`) in a real browser, over a live service:
`python -m service serve` on the session's Ray cluster, one rank pulling through
trainer.feed.Feed, and Debian's headless chromium driven by selenium. Both pages must render
from the service alone (no CDN), so every resource the browser loads comes from the service."""

import os
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import serve_process, wait_http

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

PLOTTED = """
const p = window.tokenmillPlot;
return !!p && p.mix > 0 && p.rate > 0 && p.ranks > 0 && p.history > 0;
"""

# A canvas differs from an empty canvas of its size once anything is drawn on it.
NOT_BLANK = """
const c = document.getElementById(arguments[0]), blank = document.createElement("canvas");
blank.width = c.width; blank.height = c.height;
return c.width > 0 && c.height > 0 && c.toDataURL() !== blank.toDataURL();
"""

# Every resource the page loaded (scripts, styles, fetches), as absolute URLs.
RESOURCES = "return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)];"


def offsite_url(url: str, base: str) -> bool:
    return not url.startswith((base + "/", "data:", "blob:", "about:"))


@pytest.fixture(scope="module")
def browser():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not installed (Debian: apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--disable-gpu", "--window-size=1280,1600"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture
def service(ray_cluster, tmp_path):
    """`python -m service serve` in a subprocess, as in tests/test_serve.py, with two streams."""
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30, max_bytes=4000))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts(30, start=40, max_bytes=4000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")], "weight": 0.7},
                                               "b": {"paths": [str(tmp_path / "b.jsonl")], "weight": 0.3}}}))  # fmt: skip
    address = ray_cluster.get_runtime_context().gcs_address
    env = os.environ | {"TOKENMILL_API_TOKEN": "t0ken"}
    with serve_process(cfg, address, f"page{os.getpid()}", tmp_path, env) as svc:
        yield svc


@pytest.fixture
def busy_service(service):
    """The service after rank 0 of 1 pulled a few steps over a few seconds, so that there is a
    throughput history (several one-second samples), a rank with a lag and data wait, and a
    mixture history."""
    from trainer.feed import Feed

    base = f"http://127.0.0.1:{service['port']}"
    feed = Feed.connect(service=service["name"], rank=0, world_size=1, address=service["address"])
    try:
        deadline, pulled = time.time() + 90, 0
        while time.time() < deadline:
            try:
                next(feed)
            except StopIteration:
                break
            pulled += 1
            feed.report_wait(0.01)
            m = wait_http(f"{base}/v1/metrics")
            if pulled >= 5 and m["global_step"] >= 5 and len(m["history"]) >= 3:
                break
            time.sleep(0.3)
        assert pulled >= 3, "the rank got no steps"
        yield service
    finally:
        feed.close()


def test_live_page_plots_the_running_service(browser, busy_service):
    from selenium.webdriver.support.ui import WebDriverWait

    base = f"http://127.0.0.1:{busy_service['port']}"
    m = wait_http(f"{base}/v1/metrics")
    assert len(m["history"]) >= 2 and m["global_step"] >= 3
    browser.get(f"{base}/")
    try:
        WebDriverWait(browser, 30, poll_frequency=0.5).until(lambda d: d.execute_script(PLOTTED))
    except Exception:
        status = browser.find_element("id", "status").text
        plot = browser.execute_script("return window.tokenmillPlot")
        pytest.fail(f"the page did not plot within 30 s: status {status!r}, drawn {plot}")
    plot = browser.execute_script("return window.tokenmillPlot")
    assert plot["mix"] >= 2 * 2, plot  # two streams, two or more history points each
    for canvas in ("rate", "mix", "lag"):
        assert browser.execute_script(NOT_BLANK, canvas), f"canvas #{canvas} is blank"
    status = browser.find_element("id", "status").text
    assert "unreachable" not in status and "cannot show" not in status, status
    ranks = browser.find_elements("css selector", "#ranks tbody tr")
    assert ranks and ranks[0].find_elements("tag name", "td")[0].text == "0"
    history = browser.find_elements("css selector", "#history tbody tr")
    assert history and "config" in history[-1].text  # the weights the service started with
    legend = browser.find_elements("css selector", "#mix-legend .item")
    assert [e.text for e in legend] == ["a", "b"]  # each stream: realized and target line
    offsite = [u for u in browser.execute_script(RESOURCES) if offsite_url(u, base)]
    assert not offsite, f"the page loaded resources from elsewhere: {offsite}"


def test_docs_render_offline(browser, service):
    from selenium.webdriver.support.ui import WebDriverWait

    base = f"http://127.0.0.1:{service['port']}"
    browser.get(f"{base}/docs")
    rendered = """
    const ui = document.querySelector(".swagger-ui");
    return !!ui && ui.children.length > 0 && document.querySelectorAll(".opblock").length > 0;
    """
    WebDriverWait(browser, 30, poll_frequency=0.5).until(lambda d: d.execute_script(rendered))
    text = browser.find_element("css selector", ".swagger-ui").text
    assert "/v1/mixture" in text and "/v1/metrics" in text
    assert "Unable to render" not in text
    offsite = [u for u in browser.execute_script(RESOURCES) if offsite_url(u, base)]
    assert not offsite, f"/docs loaded resources from elsewhere: {offsite}"
