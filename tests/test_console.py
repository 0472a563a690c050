"""The operator's console (agent_sessions.contrib.django's pages in the admin), in a real headless Chromium
(Debian's chromium and chromium-driver, through Selenium) against `manage.py runserver` (a real process) on
PostgreSQL: tests/console_site is the project. Runs the console acts on are in processes of their own
(tests/console_site/run_turn.py, and the project's `manage.py agent_sessions work`, which continues a turn
the console decided), or in this one; the store is read and written here through the library, as any
other process would.

Each page's screenshot is saved into the module's temporary directory, or into the directory
AGENT_SESSIONS_SCREENSHOTS names (relative to the checkout): `AGENT_SESSIONS_SCREENSHOTS=docs/img` retakes
the pictures docs/django.md shows. Every wait is on a condition (WebDriverWait, a child's line, a database
row), bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import create_engine, make_url, text

from tests import servers
from tests.model_server import ModelServer, Reply, Request, openai
from tests.test_django_app import runserver, stop

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "tests" / "console_site" / "manage.py"
SHOTS_ENV = "AGENT_SESSIONS_SCREENSHOTS"
"""Where the pages' screenshots go (docs/img retakes docs/django.md's); the module's temporary directory
otherwise, so a run of the suite leaves the checkout as it found it."""
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WAIT = 60.0
"""Seconds a wait for another process gets: far more than it takes, so a loaded machine is no failure."""
ADMIN = "/admin/agent_sessions/session/"
PASSWORD = "console-test-password"
USERS = {
    "root": None,  # a superuser: every permission
    "viewer": ["view_session"],
    "approver": ["view_session", "decide_session"],
    "operator": ["view_session", "steer_session", "cancel_session", "recover_session", "delete_session"],
    "nobody": [],  # staff, so the admin lets them in, without a permission of the console's
}
STRANDED = "con-stranded-1"


@dataclasses.dataclass
class Site:
    base: str
    env: dict[str, str]
    store: Any
    model: ModelServer
    state: Path
    db_url: str
    shots: Path

    def url(self, path: str) -> str:
        return self.base + path

    def session_url(self, session: str) -> str:
        from django.contrib.admin.utils import quote

        return f"{self.base}{ADMIN}{requests.utils.quote(quote(session), safe='')}/change/"


def manage(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, str(MANAGE), *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"manage.py {' '.join(args)} exited {out.returncode}\n{out.stdout}{out.stderr}"
    return out.stdout


MAKE_USERS = """
from django.contrib.auth.models import Permission, User
users = {users!r}
for name, perms in users.items():
    if perms is None:
        User.objects.create_superuser(name, f"{{name}}@example.com", {password!r})
        continue
    user = User.objects.create_user(name, f"{{name}}@example.com", {password!r}, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="agent_sessions", codename__in=perms))
print(sorted(p.codename for p in Permission.objects.filter(content_type__app_label="agent_sessions")))
"""


def drop_database(name: str) -> None:
    admin = create_engine(make_url(servers.POSTGRES_URL).set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def fresh_database() -> str:
    """The console's own PostgreSQL database, made anew: Django's tables and the store's, nothing else."""
    name = servers.database_name("console")
    drop_database(name)
    return servers.database_url(servers.POSTGRES_URL, name)


def serve(env: dict[str, str], output: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`runserver` of the console's project; --insecure serves the admin's and the console's static files
    with DEBUG off."""
    return runserver(env, output, MANAGE, "--insecure")


def stranded(store: Any, session: str, text: str) -> None:
    """A turn whose worker died: its message stored under its lease, the lease released, nobody answering."""
    import agent_sessions as agent
    from agent_sessions.lease import claimant

    holder = store.acquire(session, agent.Holder("web-1", 1, claimant().token, 0.0, spec="support"), 30)
    store.save_fenced(session, holder, [agent.Message.user(text, key=f"turn-{session}")], take_steers=False)
    store.release(session, holder)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from stores import postgres

    state = tmp_path_factory.mktemp("console")
    url = fresh_database()
    model = ModelServer()
    env = {**os.environ, "CONSOLE_DB_URL": url.replace("postgresql+psycopg", "postgresql"),
           "CONSOLE_STATE": str(state), "AGENT_MODEL_URL": model.url + "/v1", "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage(env, "migrate", "--noinput")
    made = manage(env, "shell", "-c", MAKE_USERS.format(users=USERS, password=PASSWORD))
    assert made.strip().splitlines()[-1] == str(sorted(
        ["cancel_session", "decide_session", "delete_session", "recover_session", "steer_session", "view_session"]))
    store = postgres.Store(create_engine(url, pool_size=2))
    stranded(store, STRANDED, "where is my refund?")  # the grace a turn gets runs while the other tests do
    server, base = serve(env, state / "runserver.log")
    try:
        yield Site(base, env, store, model, state, url, ROOT / (os.environ.get(SHOTS_ENV) or state / "screenshots"))
    finally:
        stop(server)
        store.close()
        store.engine.dispose()
        model.close()
        if os.environ.get("AGENT_SESSIONS_KEEP_DATABASES") != "1":
            drop_database(make_url(url).database or "")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("Debian's chromium and chromium-driver are needed: scripts/test installs them (scripts/browser)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                     f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(WAIT)
    driver.set_script_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# -- the browser ------------------------------------------------------------------------------------------------


def until(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = WAIT) -> Any:
    """Wait for ``condition(driver)`` to hold (an element replaced meanwhile is looked for again)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(
        condition, f"waited {timeout} s for {what}")


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, css)
    return "\n".join(e.text for e in found)


def login(driver: Any, site: Site, user: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(site.url("/admin/login/?next=/admin/"))
    driver.find_element(By.NAME, "username").send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    until(driver, lambda d: "/admin/login/" not in d.current_url, f"{user} to be logged in")


def open_page(driver: Any, url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(url)
    until(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#content"), f"{url} to load")


def following(driver: Any) -> None:
    """The session page's script is connected to the event stream."""
    until(driver, lambda d: d.execute_script(
        "return document.getElementById('console-live').dataset.connected === '1'"), "the event stream")


def shot(site: Site, driver: Any, name: str) -> None:
    site.shots.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(site.shots / f"console-{name}.png")), name


POST = """
const [url, body, done] = arguments;
const token = (document.cookie.split('; ').find(c => c.startsWith('csrftoken=')) || '=').split('=')[1];
fetch(url, {method: 'POST', credentials: 'same-origin', body: new URLSearchParams(body),
            headers: {'X-CSRFToken': token}}).then(r => done(r.status), e => done(String(e)));
"""


def forged_post(driver: Any, url: str, body: dict[str, str]) -> int:
    """A POST from the logged-in page with the user's own CSRF token, as a hand-made request would send it:
    what the server answers, once any redirect is followed."""
    return int(driver.execute_async_script(POST, url, body))


# -- processes ------------------------------------------------------------------------------------------------------


class Child:
    """A process of the console's project (Python run with ``args``), its stdout read line by line as JSON."""

    def __init__(self, site: Site, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, *args], env={**site.env, **(env or {})},
                                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.errors: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.errors.extend(self.process.stderr or []), daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout or []:
            self.lines.put(json.loads(line))

    def next(self, what: str) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"{what}: nothing within {WAIT} s; stderr:\n{''.join(self.errors)}") from None

    def wait_for(self, matches: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        while True:
            line = self.next(what)
            if matches(line):
                return line

    def stop(self) -> None:
        """SIGTERM to its pid, then a bounded wait (SIGKILL after it)."""
        stop(self.process)  # type: ignore[arg-type]


def held(gate: threading.Event, reply: Reply) -> Callable[[Request], Reply]:
    """A model reply sent once the test opens ``gate``: the run waits inside its request meanwhile."""
    def answer(request: Request) -> Reply:
        assert gate.wait(WAIT)
        return reply
    return answer


def wait_for_requests(model: ModelServer, count: int) -> None:
    import time

    deadline = time.monotonic() + WAIT
    while len(model.requests) < count:
        assert time.monotonic() < deadline, f"the model got {len(model.requests)} requests, not {count}"
        time.sleep(0.01)


def log_entries(site: Site, session: str) -> list[tuple[str, int, str]]:
    """The admin log's entries about ``session``: user, flag, message; oldest first."""
    engine = create_engine(site.db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT u.username, l.action_flag, l.change_message FROM django_admin_log l "
                "JOIN auth_user u ON u.id = l.user_id JOIN django_content_type t ON t.id = l.content_type_id "
                "WHERE t.app_label = 'agent_sessions' AND t.model = 'session' AND l.object_id = :sid "
                "ORDER BY l.id"), {"sid": session}).all()
    finally:
        engine.dispose()
    return [(str(u), int(f), str(m)) for u, f, m in rows]


def ask_for_approval(site: Site, session: str, call_id: str, arguments: str, text: str = "refund order 7") -> None:
    """A turn of ``session`` in this process that stops waiting for a person's decision on ``refund``."""
    import agent_sessions as agent
    from tests.console_site.agent import endpoint, spec

    site.model.push(openai(calls=[(call_id, "refund", arguments)]))
    os.environ["AGENT_MODEL_URL"] = site.env["AGENT_MODEL_URL"]
    result = agent.Runner().run(dataclasses.replace(spec(), session=agent.open(session, site.store)),
                                [agent.Message.user(text)], endpoint())
    assert result.stop_reason == "awaiting_approval", result


# -- the tests ------------------------------------------------------------------------------------------------------


def test_an_operator_with_only_the_view_permission_sees_but_cannot_act(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import agent_sessions as agent

    sid = "con-view-1"
    ask_for_approval(site, sid, "v-1", '{"order": "7", "amount": 80}')
    login(browser, site, "viewer")
    open_page(browser, site.session_url(sid))
    assert "waiting for approval" in text_of(browser, "#console-state h2")
    assert "refund" in text_of(browser, ".console-calls") and "v-1" in text_of(browser, ".console-calls")
    assert browser.find_elements(By.CSS_SELECTOR, "#content form") == [], "a viewer is offered a form"
    assert "You may look, not act." in text_of(browser, "#console-actions")
    open_page(browser, site.url("/admin/agent_sessions/approval/"))
    assert "v-1" in text_of(browser, "#content") and not browser.find_elements(By.CSS_SELECTOR, "#content form")

    open_page(browser, site.session_url(sid))
    refused = {action: forged_post(browser, site.session_url(sid).replace("/change/", f"/{action}/"), body)
               for action, body in (("steer", {"text": "forged"}), ("cancel", {}),
                                    ("approve", {"call_id": "v-1", "reason": "forged"}),
                                    ("deny", {"call_id": "v-1", "reason": "forged"}), ("recover", {}),
                                    ("delete", {"force": "on"}))}
    assert refused == dict.fromkeys(refused, 403), refused
    session = agent.open(sid, site.store)
    assert session.pending_steers() == [] and [p.call_id for p in session.pending_approvals()] == ["v-1"]
    assert session.info() is not None and log_entries(site, sid) == []

    # The same request from a user who holds the permission takes (so the 403s were the permission's).
    login(browser, site, "approver")
    open_page(browser, site.session_url(sid))
    assert forged_post(browser, site.session_url(sid).replace("/change/", "/deny/"),
                       {"call_id": "v-1", "reason": "not today"}) == 200
    assert session.pending_approvals() == []
    assert log_entries(site, sid) == [("approver", 2, "Denied call v-1 (refund): not today")]


def logged_in(site: Site, user: str) -> requests.Session:
    """An HTTP client logged in to the admin as ``user`` (a browser's cookies, without the browser)."""
    client = requests.Session()
    assert client.get(site.url("/admin/login/"), timeout=WAIT).status_code == 200
    logged = client.post(site.url("/admin/login/?next=/admin/"), timeout=WAIT, data={
        "username": user, "password": PASSWORD, "csrfmiddlewaretoken": client.cookies["csrftoken"],
        "next": "/admin/"})
    assert logged.url == site.url("/admin/"), logged.url
    return client


def test_a_post_without_the_csrf_token_is_refused(site: Site) -> None:
    import agent_sessions as agent

    client = logged_in(site, "root")
    steer = site.session_url("con-csrf-1").replace("/change/", "/steer/")
    assert client.post(steer, data={"text": "no token"}, timeout=WAIT).status_code == 403
    assert agent.open("con-csrf-1", site.store).pending_steers() == []
    taken = client.post(steer, data={"text": "with the token"}, headers={"X-CSRFToken": client.cookies["csrftoken"]},
                        allow_redirects=False, timeout=WAIT)
    assert taken.status_code == 302 and agent.open("con-csrf-1", site.store).pending_steers() == ["with the token"]
    assert client.get(steer, timeout=WAIT).status_code == 405  # an action is a POST


def test_a_staff_user_without_the_view_permission_reads_nothing(site: Site) -> None:
    import agent_sessions as agent

    agent.open("con-hidden-1", site.store).save([agent.Message.user("private")])
    client = logged_in(site, "nobody")
    for path in (ADMIN, ADMIN + "log/", "/admin/agent_sessions/approval/", ADMIN + "con-hidden-1/change/",
                 ADMIN + "con-hidden-1/events/"):
        answer = client.get(site.url(path), timeout=WAIT)
        assert answer.status_code == 403 and "private" not in answer.text, path
    assert "Sessions" not in client.get(site.url("/admin/"), timeout=WAIT).text  # not on the admin's index


def test_two_operators_deciding_one_call_at_once_store_and_log_one_decision(site: Site) -> None:
    """Two operators click at the same moment, one to approve and one to deny: the decision is a
    compare-and-swap, so one is stored and logged, and the other's page says the call was decided already."""
    import agent_sessions as agent

    sid = "con-race-1"
    ask_for_approval(site, sid, "race-1", '{"order": "8", "amount": 500}')
    clients = {"approver": logged_in(site, "approver"), "root": logged_in(site, "root")}
    start = threading.Barrier(len(clients))
    pages: dict[str, str] = {}

    def decide(user: str, action: str) -> None:
        client = clients[user]
        url = site.session_url(sid).replace("/change/", f"/{action}/")
        start.wait(WAIT)
        pages[user] = client.post(url, data={"call_id": "race-1", "reason": f"{user} says {action}"}, timeout=WAIT,
                                  headers={"X-CSRFToken": client.cookies["csrftoken"]}).text

    threads = [threading.Thread(target=decide, args=("approver", "approve")),
               threading.Thread(target=decide, args=("root", "deny"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    [entry] = log_entries(site, sid)
    user, flag, said = entry
    other = "root" if user == "approver" else "approver"
    assert flag == 2 and said == ("Approved call race-1 (refund): approver says approve" if user == "approver"
                                  else "Denied call race-1 (refund): root says deny")
    told = {who: re.findall(r'<li class="(success|error)">(.*?)</li>', page.split('class="messagelist"')[1],
                            re.DOTALL)[0] for who, page in pages.items()}
    assert told[user] == ("success", said), told
    assert told[other][0] == "error" and "was already decided" in told[other][1], told
    assert agent.open(sid, site.store).pending_approvals() == []


def test_an_approver_approves_a_call_and_the_page_follows_the_run_in_another_process(site: Site,
                                                                                    browser: Any) -> None:
    """The decision is stored by the page; the project's `manage.py agent_sessions work` (a deployment's
    worker without Celery, with the project's RESOLVE) runs the approved call, as it continues a decision
    taken in any process; the page, never reloaded, shows the call running, then the turn answered."""
    from selenium.webdriver.common.by import By

    import agent_sessions as agent

    sid = "con-approve-1"
    ask_for_approval(site, sid, "r-7", '{"order": "7", "amount": 80}', "refund order 7, 80 euros please")
    site.model.push(openai("refunded 80 on order 7: it reaches the card in 3 days"))
    # The project's worker, started before the decision as a deployment's is. A turn waiting for a person is not
    # open, so it has nothing to do until the decision marks the turn open again. Its resolve takes this test's
    # sessions alone: the other tests' stay as they are.
    waiting = site.store.info(sid)
    assert waiting is not None and waiting.open_since is None, waiting
    work = Child(site, str(MANAGE), "agent_sessions", "work", "--json", env={"CONSOLE_RESOLVE_PREFIX": "con-approve"})
    try:
        login(browser, site, "approver")
        open_page(browser, site.url("/admin/agent_sessions/approval/"))
        assert "r-7" in text_of(browser, "#content") and '"amount": 80' in text_of(browser, "#content")
        shot(site, browser, "approvals")
        browser.find_element(By.CSS_SELECTOR, f"a[href='{site.session_url(sid)[len(site.base):]}']").click()
        until(browser, lambda d: "waiting for approval" in text_of(d, "#console-state h2"), "the waiting call")
        following(browser)
        browser.find_element(By.CSS_SELECTOR, "form.console-decide input[name=reason]").send_keys("within policy")
        browser.find_element(By.CSS_SELECTOR, "form.console-decide .console-approve").click()
        until(browser, lambda d: "Approved call r-7 (refund): within policy" in text_of(d, ".messagelist"),
              "the decision's message")
        following(browser)
        browser.execute_script("window.consoleNotReloaded = true")

        until(browser, lambda d: "running refund (r-7)" in text_of(d, "#console-live-status"),
              "the page to show the call running")
        until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".console-call-running"),
              "the journal's call to show as running")
        shot(site, browser, "running")
        (site.state / "release-refund-7").touch()
        until(browser, lambda d: "it reaches the card in 3 days" in text_of(d, "#console-transcript"),
              "the page to show the turn answered")
        until(browser, lambda d: "turn finished (answered)" in text_of(d, "#console-live-status"), "the end")
        assert browser.execute_script("return window.consoleNotReloaded") is True, "the page was reloaded"
        assert "refunded 80 on order 7" in text_of(browser, "#console-transcript .console-result")
        shot(site, browser, "session")
        done = work.wait_for(lambda line: line.get("id") == sid, "the worker's run of the decided turn")
        assert done["outcome"] == "recovered" and done["stop_reason"] == "answered", done
    finally:
        work.stop()
    assert work.process.returncode == 0, "".join(work.errors)  # SIGTERM stops it between two looks
    assert work.wait_for(lambda line: "stopped" in line, "the worker's last line") == {
        "stopped": {"recovered": 1}}
    msgs = agent.open(sid, site.store).messages()
    results = [c for m in msgs for c in m.content if c.type is agent.ContentType.TOOL_RESULT]
    assert [(r.tool_call_id, r.text) for r in results] == [("r-7", "refunded 80 on order 7")]  # run once
    assert log_entries(site, sid) == [("approver", 2, "Approved call r-7 (refund): within policy")]


def act_on_a_running_turn(site: Site, browser: Any, session: str, question: str, act: Callable[[Any], None],
                          first: Reply, *more: Reply) -> tuple[dict[str, Any], int]:
    """A turn of ``session`` run by a process of its own, inside its first model request (``first`` is held
    until then) while the page does ``act``; the run's last line, and how many model requests came before."""
    gate = threading.Event()
    site.model.push(held(gate, first), *more)
    asked = len(site.model.requests)
    run = Child(site, "-m", "tests.console_site.run_turn", session, question)
    try:
        run.wait_for(lambda line: "started" in line, "the run to start")
        wait_for_requests(site.model, asked + 1)
        open_page(browser, site.session_url(session))
        assert f"pid {run.process.pid}" in text_of(browser, "#console-lease")  # the other process holds it
        following(browser)
        act(browser)
        following(browser)
        gate.set()
        return run.wait_for(lambda line: "stop_reason" in line, "the run's end"), asked
    finally:
        gate.set()
        run.stop()


def test_a_steer_and_a_cancel_from_the_page_land_in_runs_of_other_processes(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import agent_sessions as agent

    login(browser, site, "operator")

    def steer(driver: Any) -> None:
        assert "running" in text_of(driver, "#console-state h2")
        driver.find_element(By.ID, "console-steer-text").send_keys("check the courier too")
        driver.find_element(By.CSS_SELECTOR, "#console-steer button").click()
        until(driver, lambda d: "Steered: check the courier too" in text_of(d, ".messagelist"), "the steer")

    ended, asked = act_on_a_running_turn(site, browser, "con-steer-1", "where is order 9?", steer,
                                         openai(calls=[("l-9", "lookup", '{"order": "9"}')]),
                                         openai("order 9 was delivered; the courier confirms it"))
    assert ended["stop_reason"] == "answered"
    assert site.model.requests[asked + 1].json["messages"][-1] == {"role": "user", "content": "check the courier too"}
    until(browser, lambda d: "check the courier too" in text_of(d, "#console-transcript .console-steer"),
          "the steer to show where it landed")
    assert "order 9 was delivered" in text_of(browser, "#console-transcript")

    def cancel(driver: Any) -> None:
        driver.find_element(By.CSS_SELECTOR, "#console-cancel button").click()
        until(driver, lambda d: "Cancelled the turn: its run stops" in text_of(d, ".messagelist"), "the cancel")

    ended, asked = act_on_a_running_turn(site, browser, "con-cancel-1", "where is order 10?", cancel,
                                         openai(calls=[("l-10", "lookup", '{"order": "10"}')]))  # no second reply
    assert ended["stop_reason"] == "cancelled"
    until(browser, lambda d: "turn finished (cancelled)" in text_of(d, "#console-live-status"), "the cancel landing")
    assert len(site.model.requests) == asked + 1  # the run asked the model nothing after the cancel
    assert [c.tool_call_id for m in agent.open("con-cancel-1", site.store).messages() for c in m.content
            if c.type is agent.ContentType.TOOL_RESULT] == ["l-10"]  # closed, not run: its result says so
    assert log_entries(site, "con-steer-1") == [("operator", 2, "Steered: check the courier too")]
    assert log_entries(site, "con-cancel-1") == [
        ("operator", 2, "Cancelled the turn: its run stops before its next model request or tool call.")]

    open_page(browser, site.session_url("con-cancel-1"))
    browser.find_element(By.CSS_SELECTOR, "#console-delete button").click()
    browser.switch_to.alert.accept()
    until(browser, lambda d: "Deleted the session." in text_of(d, ".messagelist"), "the delete")
    assert agent.open("con-cancel-1", site.store).info() is None
    assert log_entries(site, "con-cancel-1")[-1] == ("operator", 3, "Deleted the session.")


def test_a_stranded_session_is_recovered_from_the_page(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import agent_sessions as agent

    login(browser, site, "operator")

    def shows_stranded(driver: Any) -> bool:
        open_page(driver, site.session_url(STRANDED))  # the grace a turn gets may still run: look again
        return "stranded" in text_of(driver, "#console-state h2")

    until(browser, shows_stranded, "the turn to count as stranded")
    open_page(browser, site.url(ADMIN + "?state=stranded"))
    assert STRANDED in text_of(browser, "#console-sessions")
    shot(site, browser, "stranded")
    open_page(browser, site.session_url(STRANDED))
    site.model.push(openai("your refund left yesterday"))
    browser.find_element(By.CSS_SELECTOR, "#console-recover button").click()
    until(browser, lambda d: "Recovered: the turn ran to its end (answered, 1 step)." in text_of(d, ".messagelist"),
          "the recovery")
    assert "your refund left yesterday" in text_of(browser, "#console-transcript")
    assert "idle" in text_of(browser, "#console-state h2")
    assert agent.open(STRANDED, site.store).messages()[-1].text == "your refund left yesterday"
    assert log_entries(site, STRANDED) == [("operator", 2, "Recovered: the turn ran to its end (answered, 1 step).")]


HOSTILE = '<script>window.consolePwned = "script"</script><img src=x onerror="window.consolePwned = \'img\'">'


def ran_nothing(driver: Any, where: str) -> None:
    """No markup of the store's made an element, and no script of it ran: once every image the page has
    (none, when it is all text) has loaded or failed, so an ``onerror`` would have run."""
    from selenium.webdriver.common.by import By

    until(driver, lambda d: d.execute_script("return [...document.images].every(i => i.complete)"), "the images")
    assert driver.execute_script("return window.consolePwned === undefined"), where
    assert not driver.find_elements(By.CSS_SELECTOR, "#content img, #content script"), where


def test_markup_in_a_transcript_shows_as_text_and_runs_nothing(site: Site, browser: Any) -> None:
    """What users typed and tools returned, and ids and metadata, reach the page as text: on the list, the
    session page (rendered, and arriving live through the event stream) and the approvals inbox."""

    import agent_sessions as agent
    from tests.console_site.agent import endpoint, spec

    @agent.tool
    def fetch_page(url: str) -> str:
        """Fetch a page.

        Args:
            url: the page
        """
        return f"the page says: {HOSTILE}"

    sid = 'con-xss-"><img src=x onerror="window.consolePwned=\'id\'">'
    site.store.set_metadata(sid, {"note": HOSTILE[:200]})
    site.store.add_steer(sid, f"steer {HOSTILE}")
    ask_for_approval(site, "con-xss-asks", "x-1", json.dumps({"order": HOSTILE, "amount": 1}), f"user {HOSTILE}")
    login(browser, site, "root")
    open_page(browser, site.session_url(sid))
    following(browser)
    gate = threading.Event()
    site.model.push(openai(calls=[("x-2", "fetch_page", json.dumps({"url": HOSTILE}))]),
                    held(gate, openai(f"it says {HOSTILE}")))
    run = agent.Runner().start(dataclasses.replace(spec(), tools=[fetch_page], session=agent.open(sid, site.store)),
                               [agent.Message.user(f"read {HOSTILE}")], endpoint())
    try:
        until(browser, lambda d: "tool_finished" in text_of(d, "#console-events-list"),
              "the tool's result to arrive through the event stream")
        ran_nothing(browser, "the tool's result, arriving through the event stream")
        assert f"fetch_page finished: the page says: {HOSTILE}" in text_of(browser, "#console-events-list")
        gate.set()
        assert run.wait(WAIT).stop_reason == "answered"
    finally:
        gate.set()
    until(browser, lambda d: f"it says {HOSTILE}" in text_of(d, "#console-transcript"), "the answer, as text")
    ran_nothing(browser, "the session page, following the run live")
    transcript = text_of(browser, "#console-transcript")
    assert f"the page says: {HOSTILE}" in transcript and f"steer {HOSTILE}" in transcript
    assert f'"url": {json.dumps(HOSTILE)}' in transcript  # the call's arguments, pretty-printed, as text
    shot(site, browser, "untrusted")
    for url in (site.url(ADMIN), site.url("/admin/agent_sessions/approval/"), site.session_url(sid),
                site.url(ADMIN + "log/")):
        open_page(browser, url)
        ran_nothing(browser, url)
    open_page(browser, site.url("/admin/agent_sessions/approval/"))
    assert f'"order": {json.dumps(HOSTILE)}' in text_of(browser, "#content")
    open_page(browser, site.url(ADMIN + "?q=con-xss"))
    assert sid in text_of(browser, "#console-sessions") and f'note="{HOSTILE[:200]}' in text_of(
        browser, "#console-sessions").replace('\\"', '"')


def test_the_list_shows_each_state_filters_searches_and_pages(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import agent_sessions as agent
    from agent_sessions.lease import claimant

    store = site.store
    for i in range(60):  # more than a page
        store.save(f"con-page-{i:02d}", [agent.Message.user(f"hello {i}"), agent.Message.assistant("hi")])
        store.set_metadata(f"con-page-{i:02d}", {"team": "a" if i % 2 else "b"})
    ask_for_approval(site, "con-state-waiting", "w-1", '{"order": "3", "amount": 20}')
    held_lease = store.acquire("con-state-running", agent.Holder("worker-3", 4242, claimant().token, 0.0,
                                                                 spec="support"), 60)
    store.save_fenced("con-state-running", held_lease, [agent.Message.user("busy")], take_steers=False)
    cancel_lease = store.acquire("con-state-cancelling", agent.Holder("worker-4", 4343, claimant().token, 0.0), 60)
    assert agent.open("con-state-cancelling", store).cancel()
    store.enqueue("con-state-queued", "q-1", "and another thing")
    login(browser, site, "viewer")
    open_page(browser, site.url(ADMIN))
    for sid, state in (("con-state-waiting", "waiting for approval"), ("con-state-running", "running"),
                       ("con-state-cancelling", "cancel asked"), ("con-state-queued", "messages queued"),
                       ("con-page-59", "idle")):
        row = browser.find_element(By.XPATH, f"//table[@id='console-sessions']//tr[.//a[text()='{sid}']]")
        assert row.find_element(By.CSS_SELECTOR, ".console-state").text == state, (sid, row.text)
    assert "pid 4242 on worker-3" in text_of(browser, "#console-sessions")
    shot(site, browser, "sessions")

    first = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#console-sessions .console-id")]
    browser.find_element(By.ID, "console-next").click()
    until(browser, lambda d: "after=" in d.current_url, "the next page")
    second = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#console-sessions .console-id")]
    assert len(first) == 50 and not set(first) & set(second)
    open_page(browser, site.url(ADMIN + "?q=con-page-+team%3Da"))
    found = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#console-sessions .console-id")]
    assert sorted(found) == [f"con-page-{i:02d}" for i in range(1, 60, 2)]
    open_page(browser, site.url(ADMIN + "?state=waiting"))
    found = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#console-sessions .console-id")]
    assert "con-state-waiting" in found and all(f in ("con-state-waiting", "con-xss-asks") for f in found), found
    assert "sessions read for this page" in text_of(browser, ".console-paging")
    open_page(browser, site.url(ADMIN + "?spec=support&q=con-state-"))
    found = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#console-sessions .console-id")]
    assert sorted(found) == ["con-state-running", "con-state-waiting"], found

    odd = "con-odd/a_b:%2F?#&x=1 \u202e\n."  # every character the admin quotes, and more, has a page
    store.save(odd, [agent.Message.user("odd one")])
    open_page(browser, site.url(ADMIN + "?q=con-odd"))
    browser.find_element(By.CSS_SELECTOR, "#console-sessions a.console-id").click()
    until(browser, lambda d: "odd one" in text_of(d, "#console-transcript"), "the odd id's page")
    assert browser.execute_script("return document.querySelector('h1 .console-id').textContent") == odd
    store.release("con-state-cancelling", cancel_lease)

    # A delete refused while a live run holds the session, then forced: the run's next write fails.
    client = logged_in(site, "operator")
    delete = site.session_url("con-state-running").replace("/change/", "/delete/")
    refused = client.post(delete, headers={"X-CSRFToken": client.cookies["csrftoken"]}, timeout=WAIT)
    assert "Not deleted: a live run holds the session (pid 4242 on worker-3" in refused.text
    assert store.info("con-state-running") is not None
    forced = client.post(delete, data={"force": "on"}, headers={"X-CSRFToken": client.cookies["csrftoken"]},
                         timeout=WAIT)
    assert forced.url == site.url(ADMIN) and "Deleted the session (forced, while a run held it)." in forced.text
    assert store.info("con-state-running") is None
    with pytest.raises(agent.LeaseLost):
        store.save_fenced("con-state-running", held_lease, [agent.Message.user("busy"), agent.Message.assistant("x")],
                          take_steers=False)
    assert log_entries(site, "con-state-running") == [("operator", 3, "Deleted the session (forced, while a run "
                                                                       "held it).")]


def test_a_long_transcript_pages_from_its_end_and_folds_what_a_summary_covers(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import agent_sessions as agent

    msgs: list[agent.Message] = []
    for i in range(60):
        msgs += [agent.Message.user(f"question {i}"), agent.Message.assistant(f"answer {i}")]
    msgs.append(agent.Message(agent.Role.USER, [agent.Content.compaction("they asked sixty questions", 0, 100)]))
    msgs += [agent.Message.user("question 60"), agent.Message.assistant("answer 60")]
    site.store.save("con-long-1", msgs)  # 123 messages; #121 summarises #1 to #100
    login(browser, site, "viewer")
    open_page(browser, site.session_url("con-long-1"))

    def numbers(driver: Any) -> list[int]:
        return [int(e.get_attribute("textContent").lstrip("#")) for e in driver.find_elements(
            By.CSS_SELECTOR, "#console-transcript article > header .console-number")]

    assert numbers(browser) == list(range(123, 73, -1))  # newest first, 50 of them
    assert "newest first, #123 to #74 of 123" in text_of(browser, "#console-transcript h2")
    summary = browser.find_element(By.CSS_SELECTOR, "#m121 details.console-summary")
    assert summary.get_attribute("open") is None and "Summary of #1 to #100" in summary.text
    folded = browser.find_element(By.CSS_SELECTOR, "details.console-covered")  # #100 and below, under #121
    assert folded.get_attribute("open") is None and "summarised by #121" in folded.text
    browser.find_element(By.ID, "console-older").click()
    until(browser, lambda d: "before=73" in d.current_url, "the older page")
    assert numbers(browser) == list(range(73, 23, -1))
    browser.find_element(By.ID, "console-older").click()
    until(browser, lambda d: "before=23" in d.current_url, "the oldest page")
    assert numbers(browser) == list(range(23, 0, -1)) and not browser.find_elements(By.ID, "console-older")
    assert "question 0" in text_of(browser, "#m1")


def test_what_operators_did_shows_each_action_with_its_user(site: Site, browser: Any) -> None:
    """The admin's log, as the console lists it, after the tests above: every kind of action, by whom."""
    from selenium.webdriver.common.by import By

    login(browser, site, "viewer")
    open_page(browser, site.url(ADMIN + "log/"))
    rows = [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in browser.find_elements(By.CSS_SELECTOR, "#console-log tbody tr")]
    done = {(who, what.split(":")[0].split(" call")[0].rstrip(".")) for _, who, _, what in rows}
    assert {("approver", "Approved"), ("approver", "Denied"), ("operator", "Steered"),
            ("operator", "Cancelled the turn"), ("operator", "Recovered"), ("operator", "Deleted the session")} <= done
    shot(site, browser, "log")
