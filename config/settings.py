"""All settings, read from the environment in this one module.

Problems found while reading the environment are kept in ``CONFIG_PROBLEMS`` and reported by the
system checks in ``config.checks`` with clear messages, instead of failing at import time.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import dj_database_url

from core.upstreams import upstream_url_problem

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("B3OS_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

CONFIG_PROBLEMS: list[tuple[str, str, str]] = []  # (id, message, hint)


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    CONFIG_PROBLEMS.append(
        ("config.E001", f"{name}={raw!r} is not a boolean.", "Use 1/0, true/false, yes/no or on/off.")
    )
    return default


def _int(name: str, default: int, *, least: int | None = None, code: str = "config.E052", hint: str = "") -> int:
    """The integer setting ``name``; one below ``least`` is reported as ``code`` (with ``hint``) and ``default``
    is used instead."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        CONFIG_PROBLEMS.append(("config.E002", f"{name}={raw!r} is not an integer.", f"Set {name} to a whole number."))
        return default
    if least is not None and value < least:
        below = "negative" if least == 0 else f"below {least}"
        CONFIG_PROBLEMS.append((code, f"{name}={value} is {below}.", hint or f"Use {least} or more."))
        return default
    return value


def _list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def _secret_key() -> str:
    key = os.environ.get("SECRET_KEY")
    if key:
        return key
    # A persistent generated key for local use, so sessions and key hashes survive restarts. Written whole under
    # another name and linked in place: of processes starting at once, the first to link wins and all read its key.
    path = VAR_DIR / "secret_key"
    if not path.exists():
        handle, written = tempfile.mkstemp(dir=VAR_DIR, prefix=".secret_key.")  # readable by its owner only
        with os.fdopen(handle, "w") as file:
            file.write(secrets.token_urlsafe(50))
        try:
            os.link(written, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(written)
    return path.read_text().strip()


DEBUG = _bool("DEBUG", False)
SECRET_KEY = _secret_key()
SECRET_KEY_FROM_ENV = bool(os.environ.get("SECRET_KEY"))
if SECRET_KEY.startswith("change-me"):
    CONFIG_PROBLEMS.append(
        (
            "config.E013",
            "SECRET_KEY is deploy/env.example's placeholder.",
            "Set it to a long random string: python3 -c 'import secrets; print(secrets.token_urlsafe(48))'.",
        )
    )
ALLOWED_HOSTS = _list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
if not ALLOWED_HOSTS:
    CONFIG_PROBLEMS.append(
        (
            "config.E007",
            "ALLOWED_HOSTS is set but names no host: the admin, /health and /metrics would answer 400 to anyone.",
            "List the names they are reached by (localhost,127.0.0.1), or leave ALLOWED_HOSTS unset.",
        )
    )
CSRF_TRUSTED_ORIGINS = _list("CSRF_TRUSTED_ORIGINS", [])

# Keyed hash for API keys; rotating it invalidates every key, so it can be pinned apart from SECRET_KEY.
API_KEY_HASH_SECRET = os.environ.get("API_KEY_HASH_SECRET", SECRET_KEY)
# Longest an API process trusts a key it has authenticated without reading it again (0: read it on every
# request). Changes reach every process at once through a version in Redis; this bounds how long a
# revocation can go unseen when that fails.
API_KEY_CACHE_SECONDS = _int("API_KEY_CACHE_SECONDS", 30, least=0, code="config.E005", hint="Use 0 or more seconds.")

# --- mode: distributed when REDIS_URL is set, embedded otherwise --------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "").strip()
if REDIS_URL and urlparse(REDIS_URL).scheme not in {"redis", "rediss", "unix"}:
    CONFIG_PROBLEMS.append(
        ("config.E003", f"REDIS_URL={REDIS_URL!r} is not a redis:// URL.", "Use redis://host:6379/0 or leave it unset.")
    )
    REDIS_URL = ""
DISTRIBUTED = bool(REDIS_URL)
# Connections each API process's Redis pool may open (per event loop); past it, a command waits for a free one.
REDIS_MAX_CONNECTIONS = _int("REDIS_MAX_CONNECTIONS", 256, least=1)
# The Retry-After of a 503 answered while Redis or the database cannot be reached.
OUTAGE_RETRY_AFTER_SECONDS = _int("OUTAGE_RETRY_AFTER_SECONDS", 2, least=0)

# --- database ----------------------------------------------------------------------------------


def _readable_by_its_owner_only(database: Path) -> None:
    """A SQLite database holds sessions and upstream keys: made, or kept, readable by its owner only (SQLite gives
    its -wal and -shm files the database's mode). An empty file is an empty database."""
    try:
        if not database.exists():
            os.close(os.open(database, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        for path in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
            if path.exists() and path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
                path.chmod(0o600)
    except OSError:  # another process made it first, or a path SQLite itself will report
        pass


_default_db = f"sqlite:///{VAR_DIR / 'b3os.sqlite3'}"
try:
    DATABASES = {
        "default": dj_database_url.parse(
            os.environ.get("DATABASE_URL") or _default_db, conn_max_age=60, conn_health_checks=True
        )
    }
except (ValueError, KeyError) as exc:
    CONFIG_PROBLEMS.append(
        ("config.E004", f"DATABASE_URL cannot be read: {exc}", "Use postgres://user:pass@host/db or sqlite:///path.")
    )
    DATABASES = {"default": dj_database_url.parse(_default_db)}
if DATABASES["default"]["ENGINE"] not in ("django.db.backends.sqlite3", "django.db.backends.postgresql"):
    # Another backend Django knows (mysql://, oracle://) would fail later, importing a driver this project lacks.
    CONFIG_PROBLEMS.append(
        (
            "config.E004",
            f"DATABASE_URL names a {urlparse(os.environ['DATABASE_URL']).scheme}:// database, which this "
            "project does not run on.",
            "Use postgres://user:pass@host/db or sqlite:///path.",
        )
    )
    DATABASES = {"default": dj_database_url.parse(_default_db)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
    # A file, not memory, for the test database: API tests reach it from several threads and processes.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
    if str(DATABASES["default"]["NAME"]) not in ("", ":memory:"):
        _readable_by_its_owner_only(Path(DATABASES["default"]["NAME"]))
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "axes",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "corsheaders",
    "config",
    "orgs",
    "inference",
    "agents",
]

MIDDLEWARE = [
    # First: the API's own envelope answers its paths without the rest of the chain.
    "corsheaders.middleware.CorsMiddleware",
    "inference.api.middleware.api_envelope",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",
]

# Browsers may call the API from any origin, as OpenAI's API lets them: keys travel in a header, never in cookies,
# so no origin gains anything a page could not send itself. Authorization must be named beside the wildcard.
CORS_URLS_REGEX = r"^/v1/"
CORS_ALLOW_ALL_ORIGINS = True
CORS_ALLOW_HEADERS = ("*", "authorization")
CORS_EXPOSE_HEADERS = (
    "x-request-id",
    "retry-after",
    "x-should-retry",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
CORS_PREFLIGHT_MAX_AGE = 600

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": f"django.contrib.auth.password_validation.{name}"}
    for name in (
        "UserAttributeSimilarityValidator",
        "MinimumLengthValidator",
        "CommonPasswordValidator",
        "NumericPasswordValidator",
    )
]

# The admin's login (django-axes): five wrong passwords for one user from one address lock that pair out for 15
# minutes (a 429), each failure logged (its name and address masked); a right password clears the count. The address
# is the connection's own, or behind a proxy on this host (deploy/'s balancer) the one it appended to X-Forwarded-For:
# the rest of that header is the client's to forge (core/addresses.py).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "core.addresses.client_address"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# Request bodies are bounded: a chat with long context and images fits, a runaway upload does not.
MAX_REQUEST_BODY_BYTES = _int("MAX_REQUEST_BODY_BYTES", 8 * 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
# ...and so are their nesting, their number of objects and arrays, and their number of values: past any, a body is
# refused before anything walks it.
MAX_JSON_DEPTH = _int("MAX_JSON_DEPTH", 64, least=1)
MAX_JSON_CONTAINERS = _int("MAX_JSON_CONTAINERS", 50_000, least=1)
MAX_JSON_VALUES = _int("MAX_JSON_VALUES", 250_000, least=1)

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
X_FRAME_OPTIONS = "DENY"

# --- behind a TLS proxy -------------------------------------------------------------------------
# The header the proxy sets on requests it received over HTTPS, as "X-Forwarded-Proto" (the value https)
# or "Name: value". Only set it when the proxy strips that header from what clients send.
_proxy_header = os.environ.get("SECURE_PROXY_SSL_HEADER", "").strip()
if _proxy_header:
    _name, _, _value = (part.strip() for part in _proxy_header.partition(":"))
    if _name and all(c.isalnum() or c == "-" for c in _name) and " " not in _value:
        SECURE_PROXY_SSL_HEADER = ("HTTP_" + _name.upper().replace("-", "_"), _value or "https")
    else:
        CONFIG_PROBLEMS.append(
            (
                "config.E006",
                f"SECURE_PROXY_SSL_HEADER={_proxy_header!r} is not a header name, or 'Name: value'.",
                "For example SECURE_PROXY_SSL_HEADER=X-Forwarded-Proto.",
            )
        )
# The session and CSRF cookies go over HTTPS only and browsers are told to use HTTPS (sent only on requests
# that came over it), unless DEBUG is on; set these to false to use the admin over plain HTTP off this host.
SESSION_COOKIE_SECURE = _bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = _bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = _int("SECURE_HSTS_SECONDS", 0 if DEBUG else 365 * 24 * 3600, least=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = _bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["orgs.authentication.APIKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["inference.api.parsers.JSONBodyParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "inference.api.errors.drf_exception_handler",
    "UNAUTHENTICATED_USER": None,
}

# --- Channels and Celery -----------------------------------------------------------------------
if DISTRIBUTED:
    CHANNEL_LAYERS = {
        "default": {
            # Pub/sub: a message is one PUBLISH, pushed to the subscriber (the list-based layer spends eight commands
            # on it, four to send and four to receive). Job events are the only traffic (inference.engine.dispatch).
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_connect_timeout": 2, "socket_timeout": 5}]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
# A job is acknowledged when a worker takes it: a worker that dies mid-job must not have the job
# re-run later for a client that is long gone; the waiting API process reports the loss instead.
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# So a worker takes a job only when a thread of its pool is free to start it. Celery otherwise reserves up to its
# prefetch count more beside those running: off the queue's list, and acknowledged only when a thread starts them,
# they would come back only after the broker's visibility timeout (an hour), past their expiry, if the worker died
# (their clients waiting for the start timeout while another worker serves the queue), and the backlog admission reads
# in Redis would not count them.
CELERY_WORKER_DISABLE_PREFETCH = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker that lost Redis keeps trying to reconnect however long it stays away (Celery's default gives up after 100
# tries, about 45 minutes, and the worker exits).
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# A worker reconnects, as from a lost connection, when Redis changes role under it (a failover: its blocked read ended
# with UNBLOCKED, then, until the name reaches the new master, its queue's declaration refused with READONLY). Those
# are channel errors to kombu, and by default a worker dies of one.
CELERY_BROKER_CHANNEL_ERROR_RETRY = True
# Tasks with late acknowledgement are cancelled on such a loss; there are none (above), so this only quiets Celery's
# warning about the setting's future default on each reconnection.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
# Connecting to the broker for a publish is tried twice at once, not for seconds: with Redis away, an API request
# answers 503 now, instead of blocking one of the few threads that publish for everyone. Workers reconnect on their
# own terms (broker_connection_retry).
# Acknowledgements stay in the worker's memory (no ack emulation in Redis): a job is never redelivered anyway, and
# with emulation an acknowledgement that Redis refused when it went away left the message to be restored when the
# connection closed, where kombu's Redis transport raised and took the worker down instead of reconnecting.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.1,
    "interval_max": 0.1,
    "ack_emulation": False,
}

# --- inference ---------------------------------------------------------------------------------
# Longest a stream may run before it is ended cleanly.
STREAM_MAX_SECONDS = _int("STREAM_MAX_SECONDS", 600, least=1)
# How long the API waits for a queued job to start on a worker, and for the next event once it runs.
JOB_START_TIMEOUT_SECONDS = _int("JOB_START_TIMEOUT_SECONDS", 120, least=1)
WORKER_SILENCE_TIMEOUT_SECONDS = _int("WORKER_SILENCE_TIMEOUT_SECONDS", 5, least=1)
# Distributed mode: how many jobs a model's queue in Redis may hold for a worker with room (each worker has taken
# as many as its runner holds, sequences and queue); a request past them is refused at once (503 overloaded).
JOB_BACKLOG_MAX = _int("JOB_BACKLOG_MAX", 4, least=1)
# The Retry-After of a request refused because its model's sequences and queue are all taken (503 overloaded).
OVERLOADED_RETRY_AFTER_SECONDS = _int("OVERLOADED_RETRY_AFTER_SECONDS", 2, least=0)

# Threads that read the jobs of runners that hold one per job (TensorRT-LLM's): how many of its jobs a process runs
# at once. On a GPU host, as many as the sequences the engine should batch, and a worker's --concurrency no more.
RUNNER_JOB_THREADS = _int("RUNNER_JOB_THREADS", 64, least=1)

# Read by the CPU runner itself (inference.engine.runners.llama_cpp), in workers and test children too; checked here.
_int("CPU_RUNNER_THREADS", 0, least=1, code="config.E051", hint="Use 1 or more threads, or leave it unset.")

# What one request may ask of the CPU runner's grammars: larger schemas are refused with a 400 naming them, since
# their grammar would take unbounded time and memory to build, or crash llama.cpp's parser. See the README.
SCHEMA_MAX_DEPTH = _int("SCHEMA_MAX_DEPTH", 48, least=1)
SCHEMA_MAX_REPETITION = _int("SCHEMA_MAX_REPETITION", 1000, least=1)
SCHEMA_MAX_PROPERTIES = _int("SCHEMA_MAX_PROPERTIES", 256, least=1)
GRAMMAR_MAX_BYTES = _int("GRAMMAR_MAX_BYTES", 1024 * 1024, least=1)
SCHEMA_MAX_ALTERNATIVES = _int("SCHEMA_MAX_ALTERNATIVES", 1024, least=1)
SCHEMA_MAX_LEADS = _int("SCHEMA_MAX_LEADS", 1_000_000, least=1)
SCHEMA_MAX_AMBIGUITY = _int("SCHEMA_MAX_AMBIGUITY", 256, least=1)

# --- usage, reports, metrics ------------------------------------------------------------------
# Raw usage records older than this many days are deleted once rolled up into daily rollups
# (0 keeps them forever); reports read the rollups for past days.
USAGE_RETENTION_DAYS = _int(
    "USAGE_RETENTION_DAYS",
    30,
    least=0,
    code="config.E020",
    hint="Use a number of days, or 0 to keep raw usage records forever.",
)
# Usage records waiting for the database while it is away (retried every second); past this the oldest are dropped,
# logged and counted in b3os_usage_records_dropped_total.
USAGE_MAX_PENDING_RECORDS = _int("USAGE_MAX_PENDING_RECORDS", 50_000, least=1)
# How often the embedded server (and Celery beat, in distributed mode) rolls usage up.
USAGE_ROLLUP_INTERVAL_SECONDS = _int("USAGE_ROLLUP_INTERVAL_SECONDS", 3600, least=1)
# `celery -A config beat` runs the rollup; some worker must consume the default queue ("celery").
CELERY_BEAT_SCHEDULE = {
    "rollup-usage": {"task": "inference.rollup_usage", "schedule": float(USAGE_ROLLUP_INTERVAL_SECONDS)},
    "prune-agent-responses": {"task": "agents.prune_responses", "schedule": 3600.0},
}
# When set, /metrics answers only requests with 'Authorization: Bearer <METRICS_TOKEN>'.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "").strip()
# How long /health waits for Celery workers to say which queues they consume.
HEALTH_WORKER_TIMEOUT_SECONDS = _int("HEALTH_WORKER_TIMEOUT_SECONDS", 1, least=1)
# How long /health answers from its last check before it checks again (0: every call checks).
HEALTH_CACHE_SECONDS = _int("HEALTH_CACHE_SECONDS", 5, least=0)

# --- agent runtime ------------------------------------------------------------------------------
# Stored conversations (store: true) are deleted this many days after their last turn (0 keeps them):
# `manage.py prune_agent_responses` or Celery beat deletes them; older turns cannot be continued meanwhile.
AGENT_RESPONSE_RETENTION_DAYS = _int(
    "AGENT_RESPONSE_RETENTION_DAYS",
    30,
    least=0,
    code="config.E030",
    hint="Use a number of days, or 0 to keep stored conversations until they are deleted.",
)
# Model steps an agent may take in one response (each server tool round trip is one); the last has no tools.
AGENT_MAX_STEPS = _int("AGENT_MAX_STEPS", 4, least=1, code="config.E031")

# What one stored conversation (all its branches) may hold: its turns, and the bytes of their items. Past
# either, a turn that would be stored is refused with 400 conversation_too_large.
AGENT_CONVERSATION_MAX_TURNS = _int("AGENT_CONVERSATION_MAX_TURNS", 256, least=1, code="config.E033")
AGENT_CONVERSATION_MAX_BYTES = _int("AGENT_CONVERSATION_MAX_BYTES", 8 * 1024 * 1024, least=1, code="config.E033")
# Longest one guardrail check may match for (all its rules over all the texts it reads); past it, the
# guardrail refuses, as if it had matched.
AGENT_GUARDRAIL_TIMEOUT_MS = _int("AGENT_GUARDRAIL_TIMEOUT_MS", 100, least=1, code="config.E032")

GATEWAY_BASE_URL = os.environ.get("GATEWAY_BASE_URL", "").strip()
if GATEWAY_BASE_URL and (_upstream_problem := upstream_url_problem(GATEWAY_BASE_URL)):
    CONFIG_PROBLEMS.append(
        (
            "config.E041",
            f"GATEWAY_BASE_URL cannot be an upstream's base URL: {_upstream_problem}.",
            "Use the upstream's API root, such as https://api.openai.com/v1, or leave it unset.",
        )
    )
GATEWAY_API_KEY = os.environ.get("GATEWAY_API_KEY", "").strip()
# Longest wait for the upstream's next bytes; connections pooled per API process.
GATEWAY_TIMEOUT_SECONDS = _int("GATEWAY_TIMEOUT_SECONDS", 60, least=1)
GATEWAY_MAX_CONNECTIONS = _int("GATEWAY_MAX_CONNECTIONS", 512, least=1)
# Charged at admission for a gateway request that sets no output limit.
GATEWAY_DEFAULT_MAX_TOKENS = _int("GATEWAY_DEFAULT_MAX_TOKENS", 4096, least=1)
# Longest a gateway answer may take, streamed or whole, however the upstream paces it.
GATEWAY_STREAM_MAX_SECONDS = _int("GATEWAY_STREAM_MAX_SECONDS", 600, least=1)
# Largest upstream answer read whole (a non-streamed response, an error body); past it the client gets a 502.
GATEWAY_MAX_RESPONSE_BYTES = _int("GATEWAY_MAX_RESPONSE_BYTES", 64 * 1024 * 1024, least=1)
# Longest `serve` lets the requests under way finish once told to stop (SIGTERM, SIGINT): it listens no more at once,
# and past this it ends the streams still running with a `server_shutting_down` error, each recorded.
SHUTDOWN_GRACE_SECONDS = _int("SHUTDOWN_GRACE_SECONDS", 25, least=0)
# Longest `serve` waits for a response to begin (a stream begins at once; streams have their own limits):
# past it the client gets a 504. A generation ends after STREAM_MAX_SECONDS, so the default leaves room for one.
HTTP_TIMEOUT_SECONDS = _int("HTTP_TIMEOUT_SECONDS", STREAM_MAX_SECONDS + 60, least=1)
# Longest `serve` waits for a request's headers and body from its first byte (past it: 408, and the connection
# closes), and for a kept-alive connection's next request to begin (past it the connection closes).
HTTP_REQUEST_READ_TIMEOUT_SECONDS = _int(
    "HTTP_REQUEST_READ_TIMEOUT_SECONDS",
    30,
    least=1,
    code="config.E040",
    hint="Use 1 or more: without a deadline, clients that send their requests slowly hold connections forever.",
)

LOG_LEVEL = os.environ.get("LOG_LEVEL", "").strip().upper() or "INFO"
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    CONFIG_PROBLEMS.append(
        ("config.E050", f"LOG_LEVEL={LOG_LEVEL!r} is not a log level.", "Use DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    )
    LOG_LEVEL = "INFO"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "request_id": {"()": "inference.api.middleware.RequestIdLogFilter"},
        "outages": {"()": "core.logs.OutageLogFilter"},
        "refusals": {"()": "core.logs.RefusalLogFilter"},
    },
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["request_id"]}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.server": {"level": "WARNING"},
        "axes.apps": {"level": "WARNING"},  # its version, at every start
        "daphne": {"level": "WARNING"},
        # llama.cpp's own log, which llama-cpp-python's callback prints at or above this logger's level: its lines
        # on loading a model (over a thousand) only when debugging.
        "llama-cpp-python": {"level": "DEBUG" if LOG_LEVEL == "DEBUG" else "WARNING"},
        # Its receive loop logs an error every second while Redis is away.
        "channels_redis.pubsub": {"filters": ["outages"]},
        # A 403 (a staff user without a permission) is logged with the traceback of its PermissionDenied, and a 503
        # (no room, a service away) as an error.
        "django.request": {"filters": ["refusals"]},
    },
}
