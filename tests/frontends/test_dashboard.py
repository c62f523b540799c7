"""GET /v1/pool and the /dashboard page on a real server (tiny random Llama, tenants configured): who may read
them, that the report says what the engine did (adapters by tier, requests, loads, tenants' counters, the
pool sampled each second), and the page as a person sees it, in headless Chromium (Debian's chromium and
chromium-driver, installed by `make setup`): it draws the report, refreshes every second, and loads
nothing from elsewhere."""
from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
import requests

from tests.frontends.server_fixture import Server, wait_until

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ADMIN, TENANT = "sk-admin-dash", "sk-acme-dash"
CONFIG = f'''
[auth]
admin_keys = ["{ADMIN}"]
[[auth.tenants]]
name = "acme"
keys = ["{TENANT}"]
adapters = ["tiny-*"]
'''


@pytest.fixture(scope="module")
def server(tiny_served, tmp_path_factory):
    model, adapters = tiny_served
    d = tmp_path_factory.mktemp("dashboard")
    shutil.copytree(adapters, d / "adapters")
    (d / "loraplex.toml").write_text(CONFIG)
    s = Server("--model", str(model), "--dtype", "float32", "--adapter-dir", str(d / "adapters"), "--frontends", "1",
               "--config", str(d / "loraplex.toml"))
    yield s
    assert s.stop() == 0


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(s, key: str, model: str, n: int = 1) -> None:
    for _ in range(n):
        r = requests.post(s.url + "/v1/completions", headers=bearer(key), timeout=60,
                          json={"model": model, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text


def pool(s) -> dict:
    r = requests.get(s.url + "/v1/pool", headers=bearer(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_only_admins_read_the_pool_and_the_page(server):
    s = server
    for path in ("/v1/pool", "/dashboard"):
        none = requests.get(s.url + path, timeout=30)
        assert none.status_code == 401, path
        assert requests.get(s.url + path, headers=bearer("sk-wrong"), timeout=30).status_code == 401
        assert requests.get(s.url + path, headers=bearer(TENANT), timeout=30).status_code == 403
        assert requests.get(s.url + path, headers=bearer(ADMIN), timeout=30).status_code == 200
    # the page asks a browser for the key, and takes it as Basic credentials (any user name)
    assert requests.get(s.url + "/dashboard", timeout=30).headers["WWW-Authenticate"] == 'Basic realm="loraplex"'
    basic = base64.b64encode(f"me:{ADMIN}".encode()).decode()
    page = requests.get(s.url + "/dashboard", headers={"Authorization": f"Basic {basic}"}, timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    wrong = base64.b64encode(f"me:{TENANT}".encode()).decode()
    assert requests.get(s.url + "/dashboard", headers={"Authorization": f"Basic {wrong}"}).status_code == 403


def test_the_report_says_what_the_engine_did(server):
    s = server
    before = pool(s)
    assert {a["name"]: a["tier"] for a in before["adapters"]} == {"tiny-r2": "listed", "tiny-r5": "listed",
                                                                  "tiny-r8": "listed"}
    complete(s, TENANT, "tiny-r2", 3)
    complete(s, ADMIN, "tiny-r8")
    r = pool(s)
    rows = {a["name"]: a for a in r["adapters"]}
    assert rows["tiny-r2"]["tier"] in ("pool", "host") and rows["tiny-r2"]["requests_last_minute"] == 3
    assert rows["tiny-r8"]["requests_last_minute"] == 1 and rows["tiny-r5"]["tier"] == "listed"
    assert rows["tiny-r2"]["file_bytes"] > 0 and rows["tiny-r2"]["last_request"] <= r["at"]
    if rows["tiny-r2"]["tier"] == "pool":
        assert rows["tiny-r2"]["pool_bytes"] > 0 and r["pages"]["adapters"] > 0
    assert {"tiny-r2", "tiny-r8"} <= {load["name"] for load in r["recent_loads"]}
    assert all(load["seconds"] > 0 for load in r["recent_loads"])
    p = r["pages"]
    assert p["kv"] + p["adapters"] + p["free"] == p["total"] and p["page_bytes"] > 0
    tenants = {t["name"]: t for t in r["tenants"]}
    assert r["policy"] == "vtc" and tenants["acme"]["counter"] > 0 and tenants["adapter:tiny-r8"]["counter"] > 0
    assert abs(sum(t["share"] for t in r["tenants"]) - 1) < 1e-9
    assert r["running"] == 0 and r["waiting"] == 0 and r["loads_in_flight"] == []
    # sampled once a second, oldest first
    assert wait_until(lambda: len(pool(s)["history"]) >= len(r["history"]) + 2, timeout=10)
    times = [h["at"] for h in pool(s)["history"]]
    assert times == sorted(times)


def test_a_composition_has_its_own_row(server):
    """Several adapters on one request (`adapters`): the composition's pages are its own, its row is named
    after its members, and each member counts the request."""
    s = server
    r = requests.post(s.url + "/v1/completions", headers=bearer(ADMIN), timeout=60,
                      json={"model": "tiny-r2", "prompt": "Hello there", "max_tokens": 2,
                            "adapters": [{"name": "tiny-r5", "scale": 0.5}]})
    assert r.status_code == 200, r.text
    rows = {a["name"]: a for a in pool(s)["adapters"]}
    row = rows["1 * tiny-r2 + 0.5 * tiny-r5"]
    assert row["tier"] in ("pool", "host") and row["requests_last_minute"] == 0
    assert row["file_bytes"] == rows["tiny-r2"]["file_bytes"] + rows["tiny-r5"]["file_bytes"]
    assert rows["tiny-r5"]["requests_last_minute"] == 1 and rows["tiny-r5"]["tier"] != "listed"


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("headless Chromium is missing: `make setup` installs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1100"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    yield driver
    driver.quit()


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, element_id).text


def test_the_page_draws_the_report_and_refreshes(server, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    s, d = server, browser
    d.execute_cdp_cmd("Network.enable", {})
    d.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": bearer(ADMIN)})
    complete(s, ADMIN, "tiny-r8")
    d.get(s.url + "/dashboard")
    WebDriverWait(d, 30).until(lambda d: text(d, "running").isdigit())
    assert text(d, "error") == ""
    r = pool(s)
    rows = d.find_elements(By.CSS_SELECTOR, "#adapters tbody tr")
    assert {(e.get_attribute("data-name"), e.get_attribute("data-tier")) for e in rows} == {
        (a["name"], a["tier"]) for a in r["adapters"]}
    assert int(text(d, "pages-kv")) + int(text(d, "pages-adapters")) + int(text(d, "pages-free")) == r["pages"]["total"]
    assert len(d.find_elements(By.CSS_SELECTOR, "#pool-chart polygon")) == 3        # KV, adapters, free
    assert len(d.find_elements(By.CSS_SELECTOR, "#loads-chart rect")) == min(30, len(r["recent_loads"]))
    assert {e.get_attribute("data-name") for e in d.find_elements(By.CSS_SELECTOR, "#tenants tbody tr")} == {
        t["name"] for t in r["tenants"]}
    # it refreshes by itself: a new report each second, and an adapter used meanwhile shows up
    # (wait for a report made after both requests ended: one made between them would show one; an arrival of the
    # earlier tests may leave the minute meanwhile, hence a range)
    first = float(d.find_element(By.ID, "updated").get_attribute("data-at"))
    prior = next(a["requests_last_minute"] for a in pool(s)["adapters"] if a["name"] == "tiny-r5")
    complete(s, TENANT, "tiny-r5", 2)
    after = pool(s)["at"]
    WebDriverWait(d, 10).until(lambda d: float(d.find_element(By.ID, "updated").get_attribute("data-at")) > after)
    assert after > first
    cell = WebDriverWait(d, 10, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: next(
        (e.find_elements(By.TAG_NAME, "td")[7].text for e in d.find_elements(By.CSS_SELECTOR, "#adapters tbody tr")
         if e.get_attribute("data-name") == "tiny-r5" and e.get_attribute("data-tier") != "listed"), None))
    assert 2 <= int(cell) <= prior + 2     # requests in the last minute
    # thousands of adapters: the table lists the first MAX_ROWS (the report's order: by tier), the note counts all
    many = dict(r, adapters=r["adapters"] + [{**r["adapters"][0], "name": f"x{i:04d}", "tier": "listed"}
                                            for i in range(1000)])
    shown, note = d.execute_script("render(arguments[0]); return [document.querySelectorAll('#adapters tbody tr')"
                                   ".length, document.getElementById('adapters-note').textContent]", many)
    assert shown == 200 and note.startswith(f"{len(many['adapters'])} adapters (") and "first 200" in note, note
    # everything it loaded came from this server
    urls = d.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(s.url + "/") for u in urls), urls
    shot = tmp_path / "dashboard.png"
    d.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print("screenshot:", shot)


def test_a_tenant_key_in_the_browser_sees_the_refusal(server, browser):
    from selenium.webdriver.common.by import By
    s, d = server, browser
    d.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": bearer(TENANT)})
    d.get(s.url + "/dashboard")
    assert "/dashboard is for admins" in d.find_element(By.TAG_NAME, "body").text
