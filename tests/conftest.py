"""Personas, factories, the OpenAI spec validator, and a live server for clients that need a real socket."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from django.test import AsyncClient
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from inference.engine import catalog, execution
from inference.engine.preflight import check_runner
from inference.models import CatalogEntry
from inference.usage import health
from inference.usage import records as usage
from orgs import lastused
from orgs.admission import clear_limits_cache, memory_store
from orgs.models import Organization
from orgs.services import create_api_key
from tests.services import free_port

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_MODEL = importlib.import_module("inference.migrations.0003_embedded_default_model").DEFAULT_MODEL
MODEL_ID = DEFAULT_MODEL["public_id"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite generates with the CPU runner in this process: one whose library crashes stops it here, by name."""
    if (problem := check_runner(DEFAULT_MODEL["runner"], DEFAULT_MODEL["runner_settings"])) is not None:
        pytest.exit(problem.message, returncode=3)
    # This process never sweeps its runners against the catalog, as a serving one does (a worker started in a test
    # would begin): its tests hold runners no catalog entry names. Tests call ``execution.sweep`` themselves.
    execution._sweeping.set()


def pytest_unconfigure(config: pytest.Config) -> None:
    """SQLite keeps a WAL database's -wal and -shm files until its last connection closes; the suite's threads
    still hold theirs when the test database is deleted, so those files go with it here."""
    from django.conf import settings

    name = settings.DATABASES["default"].get("TEST", {}).get("NAME")
    if name and not Path(name).exists():
        for sidecar in (Path(f"{name}-wal"), Path(f"{name}-shm")):
            sidecar.unlink(missing_ok=True)
    # Each process's test database (named per worker) leaves the file that tells other processes keys changed.
    for told in Path(settings.VAR_DIR).glob("test-*.keys-changed"):
        if not Path(str(told).removesuffix(".keys-changed")).exists():
            told.unlink(missing_ok=True)


# --- the OpenAI spec ------------------------------------------------------------------------------


class OpenAISpec:
    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self._registry = Registry().with_resource(
            "openai", Resource.from_contents(document, default_specification=_dialect())
        )
        self._validators: dict[str, Draft202012Validator] = {}

    def validator(self, name: str) -> Draft202012Validator:
        if name not in self._validators:
            self._validators[name] = Draft202012Validator(
                {"$ref": f"openai#/components/schemas/{name}"}, registry=self._registry
            )
        return self._validators[name]

    def validate(self, name: str, instance: Any) -> None:
        errors = sorted(self.validator(name).iter_errors(instance), key=lambda e: e.path)
        if errors:
            details = "\n".join(f"{list(e.absolute_path)}: {e.message[:300]}" for e in errors[:5])
            raise AssertionError(f"not a valid {name}:\n{details}")


def _dialect() -> Any:
    from referencing.jsonschema import DRAFT202012

    return DRAFT202012


def _honour_nullable(node: Any) -> Any:
    """The spec still marks some schemas ``nullable: true`` (OpenAPI 3.0); JSON Schema needs an explicit null."""
    if isinstance(node, list):
        return [_honour_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _honour_nullable(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        if "enum" in node and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
        if isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        elif "type" not in node:
            return {"anyOf": [node, {"type": "null"}]}
    return node


@pytest.fixture(scope="session")
def openai_spec() -> OpenAISpec:
    cache = DATA / ".openai-openapi.json"
    source = DATA / "openai-openapi.yaml"
    if cache.exists() and cache.stat().st_mtime >= source.stat().st_mtime:
        document = json.loads(cache.read_text())
    else:
        document = _honour_nullable(yaml.load(source.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
        # Written whole and moved in place: test processes running side by side may read it as it is made.
        with tempfile.NamedTemporaryFile("w", dir=DATA, suffix=".part", delete=False) as part:
            try:
                part.write(json.dumps(document, default=str))
            except BaseException:
                os.unlink(part.name)
                raise
        os.replace(part.name, cache)
    return OpenAISpec(document)


# --- personas and factories -----------------------------------------------------------------------


@pytest.fixture
def catalog_model(transactional_db: None) -> CatalogEntry:
    entry, _ = CatalogEntry.objects.get_or_create(public_id=MODEL_ID, defaults=DEFAULT_MODEL)
    return entry


@pytest.fixture
def organization(transactional_db: None) -> Organization:
    return Organization.objects.create(slug="acme", name="Acme Inc.")


@pytest.fixture
def api_key(organization: Organization) -> str:
    return create_api_key(organization=organization, name="tests")


@dataclass
class API:
    """The node API in this process, as a client with a key sees it."""

    client: AsyncClient
    key: str | None

    def _headers(self, key: str | None) -> dict[str, str]:
        key = self.key if key is None else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def get(self, path: str, *, key: str | None = None) -> Any:
        return await self.client.get(path, headers=self._headers(key))

    async def post(self, path: str, body: Any, *, key: str | None = None, raw: bool = False) -> Any:
        data = body if raw else json.dumps(body)
        return await self.client.post(path, data=data, content_type="application/json", headers=self._headers(key))


@pytest.fixture
def api(api_key: str, catalog_model: CatalogEntry) -> API:
    return API(client=AsyncClient(), key=api_key)


async def read_stream(response: Any) -> str:
    chunks = []
    async for chunk in response.streaming_content:
        chunks.append(chunk.decode() if isinstance(chunk, bytes) else chunk)
    return "".join(chunks)


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"})


@pytest.fixture(scope="session")
def _bookkeeping_written_before_the_database_goes(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """A request still finishing as its test ended (a hang-up's thread) may note a record or a key's use after the
    test's own flush: it is written here, before the session's database is dropped, and not tried against a database
    that is gone."""
    yield
    with django_db_blocker.unblock():
        usage.flush()
        lastused.flush()


@pytest.fixture(autouse=True)
def _fresh_limits_and_usage(request: pytest.FixtureRequest) -> Iterator[None]:
    catalog.clear_cache()
    health.clear_cache()
    clear_limits_cache()
    memory_store.reset()
    # Without a database, nothing could be written.
    marked = request.node.get_closest_marker("django_db") is not None
    database = marked or bool(DATABASE_FIXTURES & set(request.fixturenames))
    if database:
        request.getfixturevalue("_bookkeeping_written_before_the_database_goes")
    yield
    # The records and keys' last uses of this test land before its database is flushed.
    if database:
        usage.flush()
        lastused.flush()


# --- a live server in its own process -------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, step: float = 0.02) -> bool:
    """Whether ``condition`` holds within ``timeout`` seconds, asked every ``step``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def manage(*args: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def run_sdk_script(script: str, *args: str, folder: Path, **env: str) -> dict[str, Any]:
    """The JSON a client program printed last, run as its users run it: a fresh interpreter that imports the
    installed SDKs, never the project's own ``agents`` app (``-P``, no PYTHONPATH)."""
    environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"} | env
    run = subprocess.run(
        [sys.executable, "-P", "-c", script, *args],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def wait_for_http(url: str, timeout: float = 60.0, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


@dataclass
class LiveServer:
    url: str
    key: str
    org: str
    env: dict[str, str]
    db_path: Path
    process: subprocess.Popen[bytes]

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1/infer"

    def manage(self, *args: str) -> str:
        return manage(*args, env=self.env)

    def new_key(self, org: str) -> str:
        """A key of ``org``, made with the organization if it is new."""
        return new_key(org, env=self.env)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.db_path) as conn:
            return conn.execute(sql, params).fetchall()


# An organization (made if it is new) and a key of it, printed: one process instead of create_org and create_key.
NEW_KEY = """
from orgs.services import create_api_key, create_organization
org, _ = create_organization(slug={org!r}, name="")
print(create_api_key(organization=org, name="live-tests"))
"""


def new_key(org: str, *, env: dict[str, str]) -> str:
    return manage("shell", "-v0", "-c", NEW_KEY.format(org=org), env=env).strip()


_template_database: Path | None = None


def migrated_database(env: dict[str, str]) -> Path:
    """A migrated SQLite database, made once per run and copied for each live server: migrating anew takes seconds."""
    global _template_database
    if _template_database is None:
        folder = Path(tempfile.mkdtemp(prefix="b3os-migrated-"))
        manage("migrate", "--noinput", "-v0", env={**env, "B3OS_VAR_DIR": str(folder)})
        _template_database = folder / "b3os.sqlite3"
    return _template_database


def start_server(var_dir: Path, *, extra_env: dict[str, str] | None = None, org: str = "live") -> LiveServer:
    var_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "B3OS_VAR_DIR": str(var_dir),
        "DATABASE_URL": "",
        "REDIS_URL": "",
        # Every process of one deployment shares its SECRET_KEY (distributed mode refuses to start without one).
        "SECRET_KEY": f"live-tests-{var_dir.name}",
        **(extra_env or {}),
    }
    database = var_dir / "b3os.sqlite3"
    if env["DATABASE_URL"]:
        manage("migrate", "--noinput", "-v0", env=env)
    elif not database.exists():
        shutil.copyfile(migrated_database(env), database)
    key = new_key(org, env=env)
    process, url = _serve(var_dir / "server.log", env)
    wait_for_http(url + "/v1/infer/models", process=process)
    return LiveServer(url=url, key=key, org=org, env=env, db_path=var_dir / "b3os.sqlite3", process=process)


def _serve(log_path: Path, env: dict[str, str], attempts: int = 3) -> tuple[subprocess.Popen[bytes], str]:
    """``manage.py serve`` on a free port, once it says it listens there. Test processes running side by side each
    pick free ports: one may take the port another picked before that one's server binds it, so a server that finds
    its port taken starts again on another, and one is taken as started only on its own word (an answer on the port
    could be the other process's server)."""
    for _ in range(attempts):
        port = free_port()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "manage.py", "serve", "--port", str(port)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while process.poll() is None and f"Serving on http://127.0.0.1:{port}" not in log_path.read_text(
            errors="replace"
        ):
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the server on port {port} did not start within 60 s")
            time.sleep(0.1)
        if process.poll() is None:
            return process, f"http://127.0.0.1:{port}"
        if "Address already in use" not in log_path.read_text(errors="replace"):
            raise RuntimeError(f"server exited with {process.returncode}")
    raise RuntimeError(f"no free port for the server in {attempts} attempts")


def stop_server(server: LiveServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def node_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("live"))
    yield server
    stop_server(server)
