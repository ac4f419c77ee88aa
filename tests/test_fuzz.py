"""Hostile input, generated: about 1,800 requests to every endpoint of a live server, built from the node's own
OpenAPI document (``GET /v1/openapi.json``) with Hypothesis, then bent: fields of the wrong type, unknown ones,
schemas too large to enforce, nesting past the bounds, model names no catalog holds, bodies that are not JSON.

Every answer must be below 500, every refusal OpenAI's error object, every stream free of server faults, and the
server must still answer at the end. Generated requests stay cheap: the catalog entry they reach generates at most
two tokens in a context of 256, and the gateway's upstream is a fast local fake.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, LiveServer, start_server, stop_server, wait_for_http
from tests.services import free_port

NODE_MODEL = "fuzz/smollm2"
GATEWAY_MODEL = "fuzz/upstream"
AGENT = "fuzz.agent"
TENANT = "fuzz"

SETUP = f"""
from inference.models import CatalogEntry
from agents.models import AgentInstance
from orgs.models import Organization
default = CatalogEntry.objects.get(public_id="b3os/smollm2-135m-instruct")
fuzz, _ = CatalogEntry.objects.update_or_create(
    public_id={NODE_MODEL!r},
    defaults=dict(runner=default.runner, runner_settings=default.runner_settings, context_length=256,
                  max_output_tokens=2, json_schema=True, tools=True, image_input=True),
)
CatalogEntry.objects.filter(pk=default.pk).update(enabled=False)
agent, _ = AgentInstance.objects.update_or_create(instance_id={AGENT!r}, defaults=dict(model=fuzz, temperature=0))
agent.organizations.add(Organization.objects.get(slug={TENANT!r}))
"""

# Codes that mean the server, not the request, was at fault, even inside a stream that began with 200.
SERVER_FAULTS = frozenset({"internal_error", "generation_failed", "invalid_constraint"})


@dataclass
class Tally:
    """Every generated request's answer, by endpoint and status."""

    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def by_status(self) -> dict[int, int]:
        counts: Counter[int] = Counter()
        for (_, status), count in self.statuses.items():
            counts[status] += count
        return dict(sorted(counts.items()))

    def endpoints(self) -> dict[str, dict[int, int]]:
        table: dict[str, dict[int, int]] = {}
        for (endpoint, status), count in sorted(self.statuses.items()):
            table.setdefault(endpoint, {})[status] = count
        return table


TALLY = Tally()


@dataclass
class Fuzzed:
    server: LiveServer
    document: dict[str, Any]
    client: httpx.Client

    def send(
        self,
        endpoint: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        content_type: str = "application/json",
        tenant: bool = False,
        query: str = "",
    ) -> None:
        headers = {"Authorization": f"Bearer {self.server.key}", "Content-Type": content_type}
        if tenant:
            headers["X-Tenant-ID"] = TENANT
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        with self.client.stream(method, path + query, content=content, headers=headers) as response:
            text = response.read().decode("utf-8", errors="replace")
        TALLY.statuses[(endpoint, response.status_code)] += 1
        sent = (content or b"")[:400]
        assert response.status_code < 500, f"{method} {path}: {response.status_code} {text[:600]}\nsent: {sent!r}"
        if response.status_code >= 400:
            error = json.loads(text)["error"]
            assert set(json.loads(text)) == {"error"} and set(error) == {"message", "type", "param", "code"}, text
            assert isinstance(error["message"], str) and error["message"]
            assert isinstance(error["code"], str) and isinstance(error["type"], str)
            assert error["param"] is None or isinstance(error["param"], str)
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            assert_no_fault_in_stream(text, sent)
        else:
            json.loads(text)


def assert_no_fault_in_stream(text: str, sent: bytes) -> None:
    for line in text.split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        error = event.get("error") or (event.get("response") or {}).get("error") or {}
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message", "") if isinstance(error, dict) else ""
        assert code not in SERVER_FAULTS and "server had an error" not in message, f"{line[:600]}\nsent: {sent!r}"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(port)], cwd=ROOT)
    upstream_url = f"http://127.0.0.1:{port}"
    wait_for_http(upstream_url + "/last", process=upstream)
    server = start_server(
        tmp_path_factory.mktemp("fuzz"),
        extra_env={"GATEWAY_BASE_URL": upstream_url + "/v1", "GATEWAY_TIMEOUT_SECONDS": "5", "LOG_LEVEL": "ERROR"},
        org=TENANT,
    )
    server.manage("shell", "-c", SETUP)
    server.manage("add_gateway_model", GATEWAY_MODEL)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        document = client.get("/v1/openapi.json").json()
        yield Fuzzed(server=server, document=document, client=client)
    stop_server(server)
    upstream.terminate()


# --- strategies from the document -------------------------------------------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text()
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


FIELD_SCHEMAS = st.sampled_from(
    [
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {
            "type": "object",
            "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        },
        {"type": "string", "enum": ["yes", "no"]},
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20000}}, "required": ["a"]},
        {"type": "string", "pattern": "^[a-z]{1,20000}$"},
        {"type": "string", "pattern": "^(?=a)a$"},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1e9},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}},
        {"enum": ["x" * 1000] * 1100},
        {"$ref": "#"},
        {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}},
        {"not": {"type": "null"}},
        {"type": "object", "properties": {'\u0000"': {"type": "string"}}},
        {"type": "string", "minLength": 2.5},
        nested(20),
        nested(40),
    ]
)
SCHEMAS = FIELD_SCHEMAS | st.dictionaries(st.sampled_from(["type", "properties", "items", "pattern", "enum"]), JSON)

SMALL_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": st.text(max_size=40)}
    ),
    min_size=1,
    max_size=3,
)


@dataclass
class Bodies:
    """Request bodies for one operation, from its schema in the document, with hints that keep them cheap."""

    document: dict[str, Any]
    models: list[str]

    def hint(self, name: str) -> st.SearchStrategy[Any] | None:
        hints: dict[str, st.SearchStrategy[Any]] = {
            "model": st.sampled_from([*self.models * 6, "no/such-model", "x" * 300, "", "a b"]),
            "max_tokens": st.integers(1, 3),
            "max_completion_tokens": st.integers(1, 3),
            "max_output_tokens": st.integers(16, 18),
            "parameters": SCHEMAS,
            "schema": SCHEMAS,
            "messages": SMALL_MESSAGES,
            "route": st.sampled_from(["node", "gateway"]),
        }
        return hints.get(name)

    def of(self, schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            return st.deferred(lambda: self.of(self.document["components"]["schemas"][name], depth + 1))
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return st.one_of([self.of(option, depth + 1) for option in schema[key]])
        if "allOf" in schema:
            return self.of(schema["allOf"][0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            return st.one_of([self.of({**schema, "type": one}, depth) for one in kind])
        if depth > 8:
            return JSON_SCALARS
        if kind == "object" or "properties" in schema:
            return self._object(schema, depth)
        if kind == "array":
            items = self.of(schema.get("items", {}), depth + 1)
            return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 3), 3))
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"].replace("\\Z", "$"), fullmatch=True)
            return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30))
        if kind == "integer":
            return st.integers(schema.get("minimum", -5), schema.get("maximum", 50))
        if kind == "number":
            return st.floats(schema.get("minimum", -3), schema.get("maximum", 3), allow_nan=False)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return JSON

    def _object(self, schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))

        def value(name: str, sub: dict[str, Any]) -> st.SearchStrategy[Any]:
            hinted = self.hint(name)
            return hinted if hinted is not None else self.of(sub, depth + 1)

        optional = sorted(set(properties) - required)

        # A few of the optional fields at a time: with all of them, nearly every body breaks some rule between
        # fields, and the paths behind validation (rendering, grammars, generation) would go untried.
        @st.composite
        def build(draw: st.DrawFn) -> dict[str, Any]:
            chosen = draw(st.lists(st.sampled_from(optional), max_size=3, unique=True)) if optional else []
            names = [name for name in properties if name in required or name in chosen]
            return {name: draw(value(name, properties[name])) for name in names}

        return build()


def bent(body: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The body as generated, or with a field dropped, replaced by any JSON value, or an unknown one added."""

    @st.composite
    def bend(draw: st.DrawFn) -> Any:
        value = draw(body)
        if not isinstance(value, dict) or not value:
            return value
        how = draw(st.sampled_from(["as is", "as is", "drop", "replace", "add", "deep"]))
        key = draw(st.sampled_from(sorted(value)))
        if how == "drop":
            value.pop(key)
        elif how == "replace":
            value[key] = draw(JSON)
        elif how == "add":
            value[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
        elif how == "deep":
            deep: Any = draw(JSON)
            for _ in range(draw(st.integers(60, 900))):
                deep = [deep]
            value[key] = deep
        return value

    return bend()


RUN = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


_strategies: dict[tuple[str, tuple[str, ...]], st.SearchStrategy[Any]] = {}


def request_body(fuzzed: Fuzzed, path: str, models: list[str]) -> st.SearchStrategy[Any]:
    """The operation's bodies; built once, since building a strategy costs more than drawing from it."""
    key = (path, tuple(models))
    if key not in _strategies:
        schema = fuzzed.document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        _strategies[key] = bent(Bodies(fuzzed.document, models).of(schema))
    return _strategies[key]


# --- the endpoints ----------------------------------------------------------------------------------------


@settings(RUN, max_examples=200)
@given(data=st.data())
def test_chat_completions_on_the_node(fuzzed: Fuzzed, data: st.DataObject) -> None:
    path = "/v1/infer/chat/completions"
    body = data.draw(request_body(fuzzed, path, [NODE_MODEL]))
    if isinstance(body, dict) and body.get("route") == "gateway":
        body["route"] = "node"
    fuzzed.send("chat.completions", "POST", path, body)


@settings(RUN, max_examples=100)
@given(
    schema=SCHEMAS,
    how=st.sampled_from(["response_format", "strict tool", "forced tool", "text.format"]),
    stream=st.booleans(),
)
def test_schemas_for_structured_output_and_tools(fuzzed: Fuzzed, schema: Any, how: str, stream: bool) -> None:
    question = [{"role": "user", "content": "Answer."}]
    tool = {"type": "function", "function": {"name": "answer", "parameters": schema, "strict": how == "strict tool"}}
    body: dict[str, Any] = {"model": NODE_MODEL, "messages": question, "max_tokens": 2, "stream": stream}
    path = "/v1/infer/chat/completions"
    if how == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    elif how == "strict tool":
        body["tools"] = [tool]
    elif how == "forced tool":
        body |= {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "answer"}}}
    else:
        path = "/v1/infer/responses"
        text = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
        body = {"model": NODE_MODEL, "input": "Answer.", "max_output_tokens": 16, "stream": stream, "text": text}
    fuzzed.send("structured output", "POST", path, body)


@settings(RUN, max_examples=150)
@given(data=st.data())
def test_chat_completions_through_the_gateway(fuzzed: Fuzzed, data: st.DataObject) -> None:
    path = "/v1/infer/chat/completions"
    body = data.draw(request_body(fuzzed, path, [GATEWAY_MODEL]))
    if isinstance(body, dict):
        body["route"] = "gateway"
    fuzzed.send("chat.completions (gateway)", "POST", path, body)


@settings(RUN, max_examples=200)
@given(data=st.data())
def test_responses_on_the_node(fuzzed: Fuzzed, data: st.DataObject) -> None:
    path = "/v1/infer/responses"
    body = data.draw(request_body(fuzzed, path, [NODE_MODEL]))
    if isinstance(body, dict) and body.get("route") == "gateway":
        body["route"] = "node"
    fuzzed.send("responses", "POST", path, body)


@settings(RUN, max_examples=100)
@given(data=st.data())
def test_responses_through_the_gateway(fuzzed: Fuzzed, data: st.DataObject) -> None:
    path = "/v1/infer/responses"
    body = data.draw(request_body(fuzzed, path, [GATEWAY_MODEL]))
    if isinstance(body, dict):
        body["route"] = "gateway"
    fuzzed.send("responses (gateway)", "POST", path, body)


@settings(RUN, max_examples=175)
@given(data=st.data())
def test_agent_turns(fuzzed: Fuzzed, data: st.DataObject) -> None:
    body = data.draw(request_body(fuzzed, "/v1/responses", [AGENT]))
    if isinstance(body, dict) and data.draw(st.integers(0, 4)):
        body["stream"] = True  # the runtime answers streams only: most turns should get that far
    fuzzed.send(
        "agent responses", "POST", "/v1/responses", body, tenant=data.draw(st.sampled_from([True, True, False]))
    )


@settings(RUN, max_examples=100)
@given(data=st.data())
def test_feedback(fuzzed: Fuzzed, data: st.DataObject) -> None:
    body = data.draw(request_body(fuzzed, "/v1/feedback", []))
    fuzzed.send("feedback", "POST", "/v1/feedback", body, tenant=True)


@settings(RUN, max_examples=100)
@given(
    model=st.sampled_from([NODE_MODEL, GATEWAY_MODEL, "b3os/smollm2-135m-instruct"]) | st.text(max_size=300),
    query=st.dictionaries(
        st.sampled_from(["start", "end", "group_by", "limit", "x"]), st.text(max_size=30), max_size=3
    ),
)
def test_the_read_endpoints(fuzzed: Fuzzed, model: str, query: dict[str, str]) -> None:
    fuzzed.send("models", "GET", "/v1/infer/models")
    fuzzed.send("model", "GET", "/v1/infer/models/" + quote(model, safe=""))
    fuzzed.send("usage", "GET", "/v1/infer/usage", query="?" + urlencode(query))
    fuzzed.send("instances", "GET", "/v1/instances", tenant=bool(query))
    fuzzed.send("openapi", "GET", "/v1/openapi.json")


@settings(RUN, max_examples=250)
@given(
    path=st.sampled_from(["/v1/infer/chat/completions", "/v1/infer/responses", "/v1/responses", "/v1/feedback"]),
    raw=st.binary(max_size=200) | JSON.map(lambda value: json.dumps(value).encode()),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
    method=st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE"]),
)
def test_bodies_that_are_not_requests(fuzzed: Fuzzed, path: str, raw: bytes, content_type: str, method: str) -> None:
    fuzzed.send("raw", method, path, raw=raw, content_type=content_type, tenant=True)


def test_the_server_answered_every_generated_request_below_500_and_answers_still(fuzzed: Fuzzed) -> None:
    summary = {
        "requests": TALLY.total,
        "endpoints": TALLY.endpoints(),
        "statuses": TALLY.by_status(),
    }
    print("\nfuzzing:", json.dumps(summary))
    (fuzzed.server.db_path.parent / "fuzz-summary.json").write_text(json.dumps(summary, indent=1))

    assert TALLY.total >= 1700, summary
    assert all(status < 500 for status in TALLY.by_status()), summary
    assert fuzzed.server.process.poll() is None
    assert fuzzed.client.get("/v1/infer/models", headers={"Authorization": f"Bearer {fuzzed.server.key}"}).is_success
    assert re.search(r"b3os_requests", httpx.get(fuzzed.server.url + "/metrics").text)
