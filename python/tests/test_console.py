"""The web console (docs/CONSOLE.md) in a real browser: Debian's headless Chromium driven by
Selenium, against the live demo (`chorus serve` with the console on, and `chorus up --join`'s
agents). Each page loads without console errors and is photographed for docs/CONSOLE.md; a task
started from the CLI shows its progress and chunks live; cancel from the page stops the
researcher; a dead letter replayed from the page leaves the queue; HTML in an agent's text is
shown as text; a read-only key cannot cancel or replay."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO, ChorusProcess, NatsServer, _free_port, rust_binary

selenium = pytest.importorskip("selenium")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT = 30.0
ADMIN_KEY = "console-admin-key"
READ_KEY = "console-read-key"
SHOTS = REPO / "docs" / "console"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


CONFIG = """
[gateway]
listen = "127.0.0.1:{gateway_port}"

[gateway.console]
listen = "127.0.0.1:{console_port}"

[[gateway.identities]]
id = "console-ops"

[[gateway.scopes]]
name = "operator"
routes = ["console", "console-admin"]

[[gateway.scopes]]
name = "viewer"
routes = ["console"]

[[gateway.api_keys]]
identity = "console-ops"
sha256 = "{admin}"
scopes = ["operator"]

[[gateway.api_keys]]
identity = "console-ops"
sha256 = "{read}"
scopes = ["viewer"]
"""


class Console:
    """`chorus serve` with the gateway and its console, and the demo's agents beside it."""

    def __init__(self, server: NatsServer, tmp: Path) -> None:
        self.port = _free_port()
        config = tmp / "console.toml"
        config.write_text(
            CONFIG.format(gateway_port=_free_port(), console_port=self.port, admin=sha256(ADMIN_KEY), read=sha256(READ_KEY))
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = server
        self.coordinator = ChorusProcess(server.url, "serve", "--config", str(config), CHORUS_SERVE__METRICS_ADDR="127.0.0.1:0", RUST_LOG="info")
        self.coordinator.wait_for("console listening", within=WAIT)
        self.demo = ChorusProcess(
            server.url, "up", "--join", "--metrics-addr", f"127.0.0.1:{_free_port()}", "--interval", "2s", RUST_LOG="warn"
        )

    def chorus(self, *args: str) -> str:
        done = subprocess.run(
            [rust_binary("chorus"), "--server", self.server.url, *args], capture_output=True, text=True, timeout=WAIT
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def stop(self) -> None:
        self.demo.stop()
        self.coordinator.stop()


@pytest.fixture(scope="module")
def console(server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    c = Console(server, tmp_path_factory.mktemp("console"))
    yield c
    c.stop()


def chromedriver() -> str:
    path = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not path:
        pytest.fail("chromedriver not found: run scripts/install-chromium")
    return path


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(chromedriver()), options=options)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def login(browser: WebDriver, console: Console, key: str = ADMIN_KEY) -> None:
    browser.get(f"{console.url}/login")
    field = browser.find_element(By.ID, "credential")
    field.send_keys(key)
    field.submit()
    WebDriverWait(browser, WAIT).until(lambda d: "/login" not in d.current_url)


def errors(browser: WebDriver) -> list[dict[str, Any]]:
    """What the page wrote to the browser console at level SEVERE (script errors, failed
    loads, refused content-security-policy)."""
    return [entry for entry in browser.get_log("browser") if entry.get("level") == "SEVERE"]


def wait_for(browser: WebDriver, css: str) -> Any:
    return WebDriverWait(browser, WAIT).until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))


def watch(browser: WebDriver) -> WebDriverWait[WebDriver]:
    """A wait on a live page: an element the page re-renders between finding it and reading it
    (a task's state, the tap's log) is read again on the next poll, not a failure."""
    return WebDriverWait(browser, WAIT, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))


def shoot(browser: WebDriver, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / f"{name}.png"))


def test_each_page_loads_without_console_errors_and_is_photographed(console: Console, browser: WebDriver) -> None:
    login(browser, console)
    # The demo's agents are in the registry.
    browser.get(f"{console.url}/agents")
    WebDriverWait(browser, WAIT).until(lambda d: d.find_elements(By.CSS_SELECTOR, '[data-agent="researcher"]') or d.refresh())
    task = console.chorus("task", "submit", "--to", "writer", "--command", "draft", '"autumn"').strip().split()[-1]
    pages = {
        "agents": "/agents",
        "agent": "/agents/researcher",
        "tasks": "/tasks",
        "task": f"/tasks/{task}",
        "dead-letters": "/dlq",
        "tap": "/tap",
    }
    for name, path in pages.items():
        browser.get(f"{console.url}{path}")
        wait_for(browser, "main")
        shoot(browser, name)
        assert errors(browser) == [], f"{path}: {errors(browser)}"
    # The overview once its samples show the demo's traffic (a chart of messages by kind).
    deadline = time.monotonic() + WAIT
    while True:
        browser.get(f"{console.url}/")
        if browser.find_elements(By.CSS_SELECTOR, "#chart-kinds svg") or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-kinds svg"), "no chart of messages by kind"
    # Successes are not refusals.
    assert "code ok" not in browser.find_element(By.TAG_NAME, "main").text
    shoot(browser, "overview")
    assert errors(browser) == []


TASKS = 10_000


def test_the_task_list_with_ten_thousand_tasks_reports_its_weight_and_first_render(console: Console, browser: WebDriver) -> None:
    """Not a timed test: it records 10,000 tasks (their submissions, in the task stream as any
    requester writes them) and prints what the task list weighs and when it first renders."""
    import asyncio

    from chorus_sdk import Agent, TaskState

    async def record() -> None:
        async with Agent("py-load", servers=console.server.url, heartbeat_interval=0) as agent:
            store = agent._task_worker.store
            await store.ensure()

            async def one(i: int) -> None:
                env = store.state_message(uuid.UUID(int=0), TaskState.SUBMITTED)
                env.correlation_id = env.id
                env.to, env.name = ["writer"], "draft"
                agent.set_payload(env, f"topic {i}", None)
                await store.transition(env.id, (0, TaskState.UNKNOWN), env)

            for start in range(0, TASKS, 500):
                await asyncio.gather(*(one(i) for i in range(start, min(start + 500, TASKS))))

    asyncio.run(record())
    login(browser, console)
    deadline = time.monotonic() + WAIT
    while True:
        browser.get(f"{console.url}/tasks")
        rows = browser.find_elements(By.CSS_SELECTOR, "#tasks [data-task]")
        summary = browser.find_element(By.TAG_NAME, "main").text
        if str(TASKS) in summary.replace(",", "") or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert rows, "the task list shows tasks"
    figures = browser.execute_script(
        """
        const nav = performance.getEntriesByType('navigation')[0];
        const paint = performance.getEntriesByType('paint').find(p => p.name === 'first-contentful-paint');
        const assets = performance.getEntriesByType('resource');
        return {
          html_bytes: nav.transferSize, html_body_bytes: nav.decodedBodySize,
          asset_bytes: assets.reduce((n, r) => n + r.transferSize, 0),
          response_ms: nav.responseEnd - nav.requestStart,
          first_contentful_paint_ms: paint ? paint.startTime : null,
          dom_content_loaded_ms: nav.domContentLoadedEventEnd,
        };
        """
    )
    print(f"\nconsole task list, {TASKS} tasks recorded, {len(rows)} rows shown: {json.dumps(figures)}")
    shoot(browser, "tasks-10000")
    assert errors(browser) == []


def test_a_task_started_from_the_cli_shows_its_progress_and_chunks_live(console: Console, browser: WebDriver) -> None:
    login(browser, console)
    # Opened before the task moves on: the page follows it over server-sent events.
    task = console.chorus("task", "submit", "--to", "researcher", "--command", "research", '"tides"').strip().split()[-1]
    browser.get(f"{console.url}/tasks/{task}")
    progress = wait_for(browser, "#task-progress")
    first = progress.text
    watch(browser).until(lambda d: d.find_element(By.ID, "task-progress").text not in ("", first))
    assert "reading source" in browser.find_element(By.ID, "task-progress").text
    # The writer streams its draft word by word: the chunks arrive on the open page.
    drafted = console.chorus("task", "submit", "--to", "writer", "--command", "draft", '"autumn"').strip().split()[-1]
    browser.get(f"{console.url}/tasks/{drafted}")
    watch(browser).until(
        lambda d: d.find_element(By.ID, "task-state").get_attribute("data-state") == "completed"
    )
    chunks = browser.find_element(By.ID, "task-chunks").text
    assert len(chunks.split()) >= 3, chunks
    assert errors(browser) == []


def test_cancel_from_the_page_stops_the_researcher(console: Console, browser: WebDriver) -> None:
    login(browser, console)
    task = console.chorus("task", "submit", "--to", "researcher", "--command", "research", '"currents"').strip().split()[-1]
    browser.get(f"{console.url}/tasks/{task}")
    wait_for(browser, "#cancel").click()
    watch(browser).until(lambda d: d.find_element(By.ID, "task-state").get_attribute("data-state") == "cancelled")
    shown = json.loads(console.chorus("task", "show", task, "--json"))
    assert shown["state"] == "cancelled", shown
    console.demo.wait_for("researcher stops", within=WAIT)


class FlakyAgent:
    """A Python agent, on a thread of its own, whose durable command ``settle`` refuses its
    first delivery (5018: not retried, so dead-lettered at once) and takes every later one."""

    def __init__(self, console: Console, id: str) -> None:
        import asyncio
        import threading

        self.id = id
        self.runs: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._url = console.server.url
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT), "the flaky agent did not start"

    async def _serve(self) -> None:
        import asyncio

        from chorus_sdk import Agent, ChorusError, Context, StatusCode

        self._stop = asyncio.Event()
        async with Agent(self.id, servers=self._url, heartbeat_interval=0) as agent:

            @agent.command("settle")
            async def settle(ctx: Context) -> str:
                self.runs.append(str(ctx.envelope.id))
                if len(self.runs) == 1:
                    raise ChorusError(StatusCode.INVALID_ARGUMENT, "not yet")
                return "settled"

            await agent.flush()
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT)


def dead_letter(console: Console, agent: str) -> str:
    """A durable command to ``agent``'s ``settle`` that is refused and dead-lettered; its dead
    letter's id."""
    console.chorus("send", "--to", agent, "--command", "settle", "--durable", "1")
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        rows = json.loads(console.chorus("dlq", "ls", "--json", "--agent", agent))
        if rows:
            return str(rows[-1]["id"])
        time.sleep(0.2)
    raise AssertionError(f"no dead letter for {agent}")


def test_a_dead_letter_replayed_from_the_page_leaves_the_queue(console: Console, browser: WebDriver) -> None:
    flaky = FlakyAgent(console, "py-flaky")
    try:
        letter = dead_letter(console, flaky.id)
        replayed_from_the_page(console, browser, letter)
        deadline = time.monotonic() + WAIT
        while len(flaky.runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(flaky.runs) == 2, "the replayed command was handled"
    finally:
        flaky.close()


def replayed_from_the_page(console: Console, browser: WebDriver, letter: str) -> None:
    login(browser, console)
    browser.get(f"{console.url}/dlq/{letter}")
    wait_for(browser, "#dlq-envelope")
    wait_for(browser, "#replay").click()
    wait_for(browser, "#notice")
    ids = {str(row["id"]) for row in json.loads(console.chorus("dlq", "ls", "--json"))}
    assert letter not in ids
    browser.get(f"{console.url}/dlq/{letter}")
    assert wait_for(browser, "#error")
    assert errors(browser) == [] or all("404" in e.get("message", "") for e in errors(browser))


def test_html_in_an_agents_text_is_shown_as_text(console: Console, browser: WebDriver) -> None:
    import asyncio

    from chorus_sdk import Agent, Context

    async def run() -> None:
        async with Agent("py-sneaky", servers=console.server.url, heartbeat_interval=0.5) as agent:

            @agent.command("steal")
            async def steal(ctx: Context) -> None:
                return None

            agent.describe("steal", "<script>document.title='pwned'</script><b>bold</b>")
            await agent.flush()
            await asyncio.to_thread(look)

    def look() -> None:
        login(browser, console)
        deadline = time.monotonic() + WAIT
        while True:
            browser.get(f"{console.url}/agents/py-sneaky")
            if "<script>" in browser.find_element(By.TAG_NAME, "main").text or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        main = browser.find_element(By.TAG_NAME, "main")
        assert "<script>document.title='pwned'</script><b>bold</b>" in main.text
        assert browser.title != "pwned"
        assert main.find_elements(By.TAG_NAME, "b") == [] or all(b.text != "bold" for b in main.find_elements(By.TAG_NAME, "b"))
        shoot(browser, "escaped")

    asyncio.run(run())


def test_a_read_only_key_cannot_cancel_or_replay(console: Console, browser: WebDriver) -> None:
    flaky = FlakyAgent(console, "py-flaky-ro")
    try:
        letter = dead_letter(console, flaky.id)
    finally:
        flaky.close()
    task = console.chorus("task", "submit", "--to", "researcher", "--command", "research", '"waves"').strip().split()[-1]
    login(browser, console, READ_KEY)
    browser.get(f"{console.url}/tasks/{task}")
    wait_for(browser, "#task-state")
    assert browser.find_elements(By.ID, "cancel") == []
    browser.get(f"{console.url}/dlq/{letter}")
    wait_for(browser, "#dlq-envelope")
    assert browser.find_elements(By.ID, "replay") == []
    # Posting by hand, with the session's cookie and a page's CSRF token, is refused too.
    refused = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        fetch(arguments[0], {method: 'POST', headers: {'Content-Type': 'application/x-www-form-urlencoded'},
                             body: 'csrf=' + encodeURIComponent(arguments[1])})
          .then(r => done(r.status)).catch(e => done(String(e)));
        """,
        f"{console.url}/tasks/{task}/cancel",
        browser.execute_script("const i = document.querySelector('input[name=csrf]'); return i ? i.value : '';"),
    )
    assert refused == 403
    shown = json.loads(console.chorus("task", "show", task, "--json"))
    assert shown["state"] != "cancelled"
    console.chorus("task", "cancel", task)


def test_live_traffic_shows_a_negotiation_rounds_bids_and_award_and_pauses(console: Console, browser: WebDriver) -> None:
    login(browser, console)
    browser.get(f"{console.url}/tap?pattern=%3E")
    wait_for(browser, "#tap-log")

    def seen(text: str) -> Any:
        # Read in one go by the page's own script: rows come and go as the log moves.
        return lambda d: text in d.execute_script("return document.getElementById('tap-log').innerText")

    # The demo's orchestrator negotiates every round: its call for proposals (performative
    # negotiate), the award and the refusals told to each bidder on its bid subject, and the
    # settlement event that records the award pass by.
    WebDriverWait(browser, WAIT).until(seen("negotiate"))
    WebDriverWait(browser, WAIT).until(seen(".bid.summarize"))
    WebDriverWait(browser, WAIT).until(seen("negotiation.settled"))
    browser.find_element(By.ID, "tap-pause").click()
    watch(browser).until(lambda d: d.find_element(By.ID, "tap-state").text != "live")
    paused = len(browser.find_elements(By.CSS_SELECTOR, "#tap-log .tap-row"))
    # Paused: the demo's heartbeats and requests keep flowing, the log does not move.
    console.chorus("request", "--to", "calculator", "--command", "calculation", '{"operation": "add", "operands": [1, 2]}')
    time.sleep(1.0)  # a second of traffic that must not show (not a wait for readiness)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#tap-log .tap-row")) == paused
    assert errors(browser) == []
