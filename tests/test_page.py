"""The live page (`/`) and the API docs (`/docs`) in a real browser, over a live service:
`python -m service serve` on the session's Ray cluster, ranks pulling through
trainer.feed.Feed, and Debian's headless chromium driven by selenium. Both pages must render
from the service alone (no CDN), so every resource the browser loads comes from the service.
What the page says of a state is also checked over a fake batch server that reports exactly
that state (tests/test_monitoring.py's), served by the real API."""

import os
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import stdlib_texts, write_jsonl
from tests.rayhead import free_port, patient, serve_process, wait_http

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# a rate of zero in the status line ("ranks take 0 tok/s"), not one that ends in 0 ("430 tok/s")
ZERO_RATE = re.compile(r"(?<![\d.,])0 tok/s")

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
        deadline, pulled = time.time() + patient(90), 0
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


# What the page shows, for the page tests to read: the status line's parts, the producer's
# state, the rank rows' cells (by column header), the elements marked as alarms, the time axes.
PAGE_VIEW = """
const cells = tr => [...tr.querySelectorAll("td")].map(td => td.textContent);
const heads = [...document.querySelectorAll("#ranks thead th")].map(th => th.textContent);
const producer = document.getElementById("producer");
return {
  status: document.getElementById("status").textContent,
  producer: producer ? producer.dataset.state : null,
  producerText: producer ? producer.textContent : null,
  heads,
  ranks: [...document.querySelectorAll("#ranks tbody tr")].map(tr => Object.fromEntries(
    cells(tr).map((v, i) => [heads[i], v]))),
  warn: [...document.querySelectorAll("#ranks td.warn")].map(td => td.textContent),
  alarms: [...document.querySelectorAll(".alarm")].map(e => e.textContent),
  lagLegend: document.getElementById("lag-legend").textContent,
  lagSource: document.getElementById("lag-source").textContent,
  plot: window.tokenmillPlot,
};
"""


def page_view(browser) -> dict:
    return browser.execute_script(PAGE_VIEW)


def wait_page(browser, ok, what: str, timeout: float = 60) -> dict:
    """The page's view once `ok(view)` holds; fails with the last view otherwise."""
    deadline, view = time.time() + timeout, {}
    while time.time() < deadline:
        view = page_view(browser)
        if view["plot"] and ok(view):
            return view
        time.sleep(0.5)
    pytest.fail(f"the page did not show {what} within {timeout} s: {view}")


def assert_one_time_axis(view: dict) -> None:
    axes = view["plot"]["axes"]
    assert set(axes) == {"rate", "mix", "lag"}, axes
    assert axes["rate"] == axes["mix"] == axes["lag"], f"charts on different time axes: {axes}"


@pytest.fixture
def fake_service():
    """The real API over tests/test_monitoring.py's fake batch server (uvicorn in a thread):
    the page shows exactly the metrics the test sets in `server.m`."""
    import uvicorn

    from service.api import Backend, create_app
    from tests.test_monitoring import FakeServer, metrics

    now = time.time()
    history = [{"t": now - 40 + i, "tokens": 1000 * i, "rows": 4 * i,
                "shares": {"web": 0.5, "code": 0.5}, "targets": {"web": 0.5, "code": 0.5}}
               for i in range(20)]  # made steps for 20 s, then the window filled  # fmt: skip
    observations = [{"t": now - 40 + 2 * i, "producer": "making" if i < 10 else "window_full",
                     "lag": {"0": 30 + i}} for i in range(20)]  # what the service saw  # fmt: skip
    server = FakeServer(metrics(history=history, observations=observations, real_tokens=19_000))
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(create_app(Backend(server)), host="127.0.0.1",
                                        port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        yield {"base": f"http://127.0.0.1:{port}", "server": server}
    finally:
        web.should_exit = True
        thread.join(timeout=10)


def test_page_tells_a_full_window_and_a_slow_rank_apart_from_alarms(browser, fake_service):
    """A rank training at step 7 with 25 steps buffered, the producer waiting on a full window:
    the page says so, shows where the rank trains, and raises no alarm; a lost rank does."""
    from tests.test_monitoring import RANKS

    server = fake_service["server"]
    server.m["ranks"] = {"0": RANKS["0"]}  # the healthy slow one only
    browser.get(fake_service["base"] + "/")
    view = wait_page(browser, lambda v: v["producer"] == "window_full", "the producer state")
    assert "waiting on a full window" in view["producerText"], view["status"]
    assert "tok/s" not in view["producerText"] and not ZERO_RATE.search(view["status"])
    assert "trainers at step 7" in view["status"]
    assert not view["alarms"], f"alarms on a healthy service: {view['alarms']}"
    assert "next step" not in " ".join(view["heads"])
    (rank,) = view["ranks"]
    assert rank["rank"] == "0" and rank["state"] == "ok" and rank["trains at step"] == "7"
    assert rank["buffered"] == "25" and rank["last sign of life"] == "1.5 s ago"
    assert "32" not in rank.values()  # its fetched step is not shown as where it is
    assert rank["lag (steps; normal ≤ 64)"] == "57" and not view["warn"]  # within its normal range
    assert "normal: 0–64 steps" in view["lagLegend"]
    assert_one_time_axis(view)
    # the lag the service saw before the page opened is drawn, on the same axis
    assert view["plot"]["lag"] >= 20 and view["lagSource"] == "sampled by the service"
    # The same page alarms on what is wrong: a lost rank, a lag above its normal range.
    server.m["ranks"] = RANKS | {"2": RANKS["0"] | {"lag": 90}}
    view = wait_page(browser, lambda v: len(v["ranks"]) == 3, "three ranks")
    assert "1 rank LOST" in view["alarms"] and "LOST" in view["alarms"], view["alarms"]
    assert view["warn"] == ["90 (above normal)"]
    server.m["producer"] = "making"
    view = wait_page(browser, lambda v: v["producer"] == "making", "a making producer")
    assert "tok/s" in view["producerText"]
    # What the trainers take, beside what is made; a stall named while it happens.
    server.m |= {"consumed_tokens_per_s": 1234.4, "stall": "ranks [0] waiting 46 s: paused"}
    view = wait_page(browser, lambda v: "STALL" in " ".join(v["alarms"]), "the stall")
    assert "trainers take 1,234 tok/s" in view["status"]
    assert "STALL: ranks [0] waiting 46 s: paused" in view["alarms"]


def test_page_draws_loss_per_stream_and_the_policy_waiting_for_it(browser, fake_service):
    """The ranks' loss per stream by step, the mixing policy's decisions marked, and a
    producer waiting for a window's loss said as such (normal at a decision: no alarm)."""
    from tests.test_monitoring import RANKS

    server = fake_service["server"]
    history = [{"step": s, "loss": {"web": 9.0 - s / 10, "code": 8.0 - s / 20},
                "tokens": {"web": 100, "code": 80}} for s in range(30)]  # fmt: skip
    server.m["stream_loss"] = {"streams": {"web": {"loss": 6.1, "tokens": 5000, "steps": 30},
                                           "code": {"loss": 6.6, "tokens": 4000, "steps": 30}},
                               "history": history, "reports": 60}  # fmt: skip
    server.m["policy"] = {"every": 5, "delay": 18, "eta": 1.0, "smoothing": 0.0,
                          "waiting_for_steps": [25, 30],
                          "decisions": [{"step": 23, "window": [0, 5], "loss": {"web": 8.8},
                                         "weights": {"web": 0.6, "code": 0.4}}]}  # fmt: skip
    server.m["producer"] = "waiting_for_loss"
    server.m["ranks"] = {"0": RANKS["0"]}  # a healthy rank only
    server.m["autoscale"] = {"max_cpus": 64, "requested_cpus": 5, "changes": [
        {"t": 0, "requested_cpus": 5, "reason": "ranks waited up to 20% of the last 60 s",
         "error": None}]}  # fmt: skip
    browser.get(fake_service["base"] + "/")
    view = wait_page(browser, lambda v: v["producer"] == "waiting_for_loss", "the policy's wait")
    assert view["plot"]["loss"] == 60, view["plot"]  # 30 steps x 2 streams
    assert "waiting for the ranks' loss" in view["producerText"]
    assert "asking the cluster for 5 CPUs (ranks waited up to 20%" in view["status"]
    assert not view["alarms"], view["alarms"]
    assert browser.execute_script(NOT_BLANK, "loss")
    legend = browser.execute_script("return document.getElementById('loss-legend').textContent")
    note = browser.execute_script("return document.getElementById('loss-note').textContent")
    assert "web" in legend and "mixing policy decision" in legend
    assert "a decision every 5 steps, 18 steps after its window" in note
    assert "6.1000" in browser.execute_script(
        "return document.querySelector('#streams tbody').textContent"
    )


def test_docs_try_it_out_sends_the_bearer_token(browser, fake_service):
    """In /docs: Authorize with the token, then "Try it out" on POST /v1/pause succeeds."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.test_monitoring import TOKEN

    op = "#operations-default-pause_v1_pause_post"
    wait = WebDriverWait(browser, 30, poll_frequency=0.3)

    def click(css: str) -> None:
        wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, css))).click()

    os.environ["TOKENMILL_API_TOKEN"] = TOKEN  # the API reads it per request
    try:
        browser.get(fake_service["base"] + "/docs")
        click("button.authorize")
        token = ".auth-container input[type=text], .auth-container input[type=password]"
        wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, token))).send_keys(TOKEN)
        click(".auth-container button[type=submit]")
        click(".modal-ux button.btn-done")
        click(f"{op} .opblock-summary")
        click(f"{op} button.try-out__btn")
        click(f"{op} button.execute")
        answered = f"{op} .live-responses-table tr.response .response-col_status"
        status = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, answered)))
        assert status.text.strip().startswith("200"), status.text
        assert fake_service["server"].paused
    finally:
        del os.environ["TOKENMILL_API_TOKEN"]


@pytest.fixture
def slow_service(ray_cluster, tmp_path):
    """`serve` with a small window (8 steps) and a short rank timeout (4 s), so that a rank
    training at ~0.6 s a step fills the window within seconds and fetches less often than the
    timeout: alive only by its client's heartbeat."""
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts(30, max_bytes=4000))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"seq_len": 64, "global_batch_size": 4, "shuffle": {"window": 4},
                                   "streams": {"a": {"paths": [str(tmp_path / "a.jsonl")]}},
                                   "service": {"prefetch": 8, "rank_timeout_s": 4}}))  # fmt: skip
    address = ray_cluster.get_runtime_context().gcs_address
    env = os.environ | {"TOKENMILL_API_TOKEN": "t0ken"}
    with serve_process(cfg, address, f"slow{os.getpid()}", tmp_path, env) as svc:
        yield svc


def test_live_page_and_metrics_for_a_healthy_slow_rank(browser, slow_service):
    """A real rank that trains slowly (0.6 s a step, 8 steps per fetch, a 4 s rank timeout):
    the page says the producer waits on a full window, raises no alarm, and shows the step the
    rank trains at; /metrics agrees."""
    from trainer.feed import Feed

    base = f"http://127.0.0.1:{slow_service['port']}"
    feed = Feed.connect(service=slow_service["name"], rank=0, world_size=1,
                        address=slow_service["address"])  # fmt: skip
    consumed, stop = [0], threading.Event()

    def train():
        while not stop.is_set():
            try:
                next(feed)
            except StopIteration:
                return
            consumed[0] += 1
            stop.wait(0.6)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        browser.get(f"{base}/")
        # Past one rank timeout of training on buffered steps, the window full meanwhile.
        time.sleep(6)
        view = wait_page(
            browser,
            lambda v: (
                v["producer"] == "window_full"
                and v["ranks"]
                and v["ranks"][0]["trains at step"] not in ("–", "0")
            ),
            "a full window and the rank's step",
        )
        assert "waiting on a full window" in view["producerText"], view["producerText"]
        assert not ZERO_RATE.search(view["status"]), view["status"]
        assert not view["alarms"], f"alarms on a healthy slow rank: {view['alarms']}"
        (rank,) = view["ranks"]
        at = int(rank["trains at step"].replace(",", ""))
        assert consumed[0] - 8 <= at <= consumed[0] + 1, (
            at,
            consumed[0],
        )  # a beat and a page tick late
        assert rank["state"] == "ok" and not view["warn"], view
        sign = float(rank["last sign of life"].split()[0])
        assert sign < 4, rank  # it beats, though it fetches every ~5 s
        assert_one_time_axis(view)
        m = wait_http(f"{base}/v1/metrics")
        assert m["ranks"]["0"]["lag"] <= m["lag_normal_max"] and not m["ranks"]["0"]["lost"]
        import urllib.request

        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        assert 'tokenmill_rank_lost{rank="0"} 0.0' in lines
        assert 'tokenmill_producer_state{state="window_full"} 1.0' in lines
        assert any(line.startswith('tokenmill_rank_consumed_step{rank="0"}') for line in lines)
    finally:
        stop.set()
        trainer.join(timeout=10)
        feed.close()


LANES_VIEW = """
const box = document.getElementById("lanes-box");
const heads = [...document.querySelectorAll("#lanes thead th")].map(th => th.textContent);
return {
  hidden: box.hidden,
  rows: [...document.querySelectorAll("#lanes tbody tr")].map(tr => Object.fromEntries(
    [...tr.querySelectorAll("td")].map((td, i) => [heads[i], td.textContent]))),
  warn: [...document.querySelectorAll("#lanes td.warn")].map(td => td.textContent),
  note: document.getElementById("lanes-note").textContent,
  drawn: (window.tokenmillPlot || {}).lanes,
};
"""


def test_page_shows_each_lane_the_slowest_a_restart_and_one_waiting_to_be_placed(browser,
                                                                                 fake_service):  # fmt: skip
    """With `lanes` > 1 the page lists each lane: where it runs, or how long it has waited to
    be placed (a lane started again where no node has its resources), the steps it holds, its
    making seconds and CPU, the slowest (the one a step waits for) and its restarts; without
    lanes the table is hidden."""
    server = fake_service["server"]
    browser.get(fake_service["base"] + "/")
    wait_page(browser, lambda v: True, "the page")
    assert browser.execute_script(LANES_VIEW)["hidden"]  # one feed: no lanes to show
    server.m |= {
        "lanes": [
            {"lane": 0, "pid": 4101, "host": "data-0", "node_ip": "10.0.0.7",
             "node_id": "3f1e9a0c77d2", "waiting_s": None, "restarts": 0,
             "held_steps": 80, "making_s": 41.5, "making_cpu_s": 39.8},
            {"lane": 1, "pid": None, "host": None, "waiting_s": 12.4, "restarts": 1,
             "held_steps": 64, "making_s": 20.0, "making_cpu_s": 9.0},
        ],
        "lanes_waited_s": 3.31, "lanes_chunks_ahead": 4,
        "lanes_restarted": [{"lane": 1, "step": 960, "steps": 128, "reason": "ActorDiedError",
                             "at": time.time(), "restart": 1}],
    }  # fmt: skip
    deadline = time.time() + patient(30)
    while (view := browser.execute_script(LANES_VIEW))["drawn"] != 2:
        assert time.time() < deadline, f"the page did not show the lanes: {view}"
        time.sleep(0.5)
    assert not view["hidden"]
    first, second = view["rows"]
    assert (
        first["lane"] == "0 (slowest)"
        and first["process"] == "pid 4101 on data-0, node 10.0.0.7 3f1e9a0c"
    )
    assert first["held steps"] == "80" and first["making, s"] == "41.5"
    assert first["CPU ÷ wall"] == "0.96" and first["restarts"] == "0"
    assert second["lane"] == "1" and second["process"] == "waiting to be placed, 12 s"
    assert second["CPU ÷ wall"] == "0.45" and second["restarts"] == "1"
    assert view["warn"] == ["waiting to be placed, 12 s", "1"]
    assert "the producer waited 3.3 s for the lanes' answers" in view["note"]
    assert "4 chunks of steps asked ahead" in view["note"]
    assert "lane 1, its process gone (ActorDiedError), started again from step 960" in view["note"]
