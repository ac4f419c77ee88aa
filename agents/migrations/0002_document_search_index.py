"""The full-text index of documents: FTS5 on SQLite (kept in step by triggers), a GIN index on PostgreSQL.

Other databases, and SQLite builds without FTS5, get nothing here: ``agents.search`` falls back to
matching words in Python.
"""

from django.db import migrations

SQLITE_CREATE = [
    "CREATE VIRTUAL TABLE agents_document_fts USING fts5("
    "title, text, instance_id UNINDEXED, content='agents_document', content_rowid='id', "
    "tokenize='porter unicode61')",
    "CREATE TRIGGER agents_document_fts_insert AFTER INSERT ON agents_document BEGIN "
    "INSERT INTO agents_document_fts(rowid, title, text, instance_id) "
    "VALUES (new.id, new.title, new.text, new.instance_id); END",
    "CREATE TRIGGER agents_document_fts_delete AFTER DELETE ON agents_document BEGIN "
    "INSERT INTO agents_document_fts(agents_document_fts, rowid, title, text, instance_id) "
    "VALUES ('delete', old.id, old.title, old.text, old.instance_id); END",
    "CREATE TRIGGER agents_document_fts_update AFTER UPDATE ON agents_document BEGIN "
    "INSERT INTO agents_document_fts(agents_document_fts, rowid, title, text, instance_id) "
    "VALUES ('delete', old.id, old.title, old.text, old.instance_id); "
    "INSERT INTO agents_document_fts(rowid, title, text, instance_id) "
    "VALUES (new.id, new.title, new.text, new.instance_id); END",
    "INSERT INTO agents_document_fts(agents_document_fts) VALUES ('rebuild')",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS agents_document_fts_insert",
    "DROP TRIGGER IF EXISTS agents_document_fts_delete",
    "DROP TRIGGER IF EXISTS agents_document_fts_update",
    "DROP TABLE IF EXISTS agents_document_fts",
]
POSTGRES_CREATE = [
    "CREATE INDEX agents_document_search ON agents_document USING GIN ("
    "(setweight(to_tsvector('english'::regconfig, COALESCE(title, '')), 'A') || "
    "setweight(to_tsvector('english'::regconfig, COALESCE(text, '')), 'B')))",
]
POSTGRES_DROP = ["DROP INDEX IF EXISTS agents_document_search"]


def _has_fts5(connection) -> bool:
    with connection.cursor() as cursor:
        try:
            cursor.execute("CREATE VIRTUAL TABLE temp.agents_fts5_probe USING fts5(x)")
        except Exception:  # noqa: BLE001  (an SQLite built without FTS5)
            return False
        cursor.execute("DROP TABLE temp.agents_fts5_probe")
    return True


def _statements(connection, *, create: bool) -> list[str]:
    if connection.vendor == "sqlite" and (not create or _has_fts5(connection)):
        return SQLITE_CREATE if create else SQLITE_DROP
    if connection.vendor == "postgresql":
        return POSTGRES_CREATE if create else POSTGRES_DROP
    return []


def create_index(apps, schema_editor):
    for statement in _statements(schema_editor.connection, create=True):
        schema_editor.execute(statement)


def drop_index(apps, schema_editor):
    for statement in _statements(schema_editor.connection, create=False):
        schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("agents", "0001_initial")]
    operations = [migrations.RunPython(create_index, drop_index)]
