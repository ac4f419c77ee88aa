"""The knowledge search on PostgreSQL, production's database: a throwaway cluster, the project's migrations
(with the GIN index), the demo instance, and the same questions the SQLite tests ask. `make test`
installs PostgreSQL's server programs (Debian's postgresql) and psycopg."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import manage
from tests.services import free_port


def program(name: str) -> str:
    """A PostgreSQL server program: on PATH, or where Debian's postgresql package puts it."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: `make test` installs Debian's postgresql package")
    return found


SEARCH = """
import json
from agents.models import AgentInstance
from agents.tools.search import search_documents
instance = AgentInstance.objects.get()
questions = {questions!r}
hits = {{q: search_documents(instance_id=instance.pk, query=q, limit=3) for q in questions}}
print(json.dumps({{q: [h.title for h in found] for q, found in hits.items()}}))
"""


def run(*command: str) -> None:
    # PostgreSQL refuses to run as root: as root, its programs run as nobody.
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    subprocess.run([*as_user, *command], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def postgres_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="b3os-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "nobody")
    port = free_port()
    run(program("initdb"), "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
    run(
        program("pg_ctl"),
        "-D",
        str(root / "data"),
        "-o",
        f"-p {port} -k {root} -c listen_addresses=''",
        "-l",
        str(root / "log"),
        "-w",
        "start",
    )
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://postgres@/postgres?host={root}&port={port}",
        "B3OS_VAR_DIR": str(tmp_path_factory.mktemp("pg-var")),
        "REDIS_URL": "",
    }
    try:
        manage("migrate", "--noinput", "-v0", env=env)
        manage("create_org", "acme", env=env)
        manage("create_demo_instance", "acme", env=env)
        yield env
    finally:
        run(program("pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_postgres_full_text_search_ranks_the_documents_as_sqlite_does(postgres_env: dict[str, str]) -> None:
    questions = ["How do I replace the drive belts?", "filter service intervals", "What is it?", 'belt" OR title:* :)']

    found = json.loads(
        manage("shell", "-c", SEARCH.format(questions=questions), env=postgres_env).strip().splitlines()[-1]
    )

    assert found[questions[0]][0] == "Replacing the B-220 drive belt"
    assert found[questions[1]] == ["C-31 filter cartridge: service intervals", "Machine 4711: compatible spare parts"]
    assert found[questions[2]] == []
    assert found[questions[3]][0] == "Replacing the B-220 drive belt"


def test_the_migration_gives_postgres_a_gin_index_for_the_search(postgres_env: dict[str, str]) -> None:
    script = (
        "from django.db import connection\n"
        "c = connection.cursor()\n"
        "c.execute(\"SELECT indexdef FROM pg_indexes WHERE indexname = 'agents_document_search'\")\n"
        "print(c.fetchone()[0])"
    )

    assert "USING gin" in manage("shell", "-c", script, env=postgres_env)
