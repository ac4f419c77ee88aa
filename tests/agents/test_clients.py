"""The agent runtime against a live server, as its clients see it: the openai SDK with X-Tenant-ID, the OpenAI
Agents SDK, and curl's view of the stream (``Accept: text/event-stream``), on the demo instance ``make run``
creates; and streams a live server's model cannot be made to send, read by the Agents SDK as it reads them off the
wire."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from agents.models import AgentInstance, FirstStep
from inference.models import CatalogEntry
from tests.agents.conftest import AGENT_CALL, SeedClient, Tenant, check_stream, message_text
from tests.conftest import MODEL_ID, LiveServer, OpenAISpec, read_stream, run_sdk_script
from tests.inference.test_responses import parse_events, toy_model  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def demo_instance(node_server: LiveServer) -> str:
    return node_server.manage("create_demo_instance", node_server.org).strip()


def test_the_openai_sdk_holds_a_cited_conversation_with_the_demo_instance(
    node_server: LiveServer, demo_instance: str
) -> None:
    client = OpenAI(
        api_key=node_server.key,
        base_url=f"{node_server.url}/v1",
        default_headers={"X-Tenant-ID": node_server.org},
        max_retries=0,
        timeout=120,
    )
    question = "Which spare parts are compatible with machine 4711?"

    events = list(
        client.responses.create(model=demo_instance, input=question, stream=True, max_output_tokens=48, temperature=0)
    )

    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    first = events[-1].response
    assert [item.type for item in first.output] == ["agent_runtime:function_call", "message"]
    assert first.output_text and first.output[1].content[0].annotations[0].url.startswith("https://docs.example.com/")

    follow = client.responses.create(
        model=demo_instance,
        input="How often is its filter changed?",
        previous_response_id=first.id,
        stream=True,
        max_output_tokens=24,
        temperature=0,
    )
    second = [event for event in follow if event.type == "response.completed"][0].response
    assert second.previous_response_id == first.id and second.output_text

    with pytest.raises(Exception) as refused:
        client.responses.create(model=demo_instance, input=question, max_output_tokens=16)
    assert getattr(refused.value, "status_code", None) == 400


# Run apart from the project, whose ``agents`` app would shadow the SDK's package of the same name.
AGENTS_SDK_SCRIPT = """
import asyncio, json, os
import agents
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)

async def run():
    client = AsyncOpenAI(
        api_key=os.environ["B3OS_KEY"],
        base_url=os.environ["B3OS_BASE_URL"],
        default_headers={"X-Tenant-ID": os.environ["B3OS_TENANT"]},
        max_retries=0,
    )
    agent = Agent(
        name="Spare parts",
        # The instance holds its own instructions and tools: the runtime runs its knowledge search itself.
        model=OpenAIResponsesModel(model=os.environ["B3OS_INSTANCE"], openai_client=client),
        model_settings=ModelSettings(max_tokens=48, temperature=0, store=True),
    )
    first = Runner.run_streamed(agent, "Which spare parts are compatible with machine 4711?")
    kinds = [event.type async for event in first.stream_events()]
    # The runtime answers in event streams only, as its API reference says: the SDK's streamed runs.
    second = Runner.run_streamed(agent, "How often is its filter changed?", previous_response_id=first.last_response_id)
    async for _ in second.stream_events():
        pass
    return {
        "sdk": agents.__file__,
        "kinds": sorted(set(kinds)),
        "first": first.final_output,
        "first_id": first.last_response_id,
        "second": second.final_output,
        "second_id": second.last_response_id,
    }

print(json.dumps(asyncio.run(run())))
"""


def test_the_agents_sdk_holds_a_conversation_with_the_demo_instance(
    node_server: LiveServer, demo_instance: str, tmp_path: Path
) -> None:
    result = run_sdk_script(
        AGENTS_SDK_SCRIPT,
        folder=tmp_path,
        B3OS_KEY=node_server.key,
        B3OS_BASE_URL=f"{node_server.url}/v1",
        B3OS_TENANT=node_server.org,
        B3OS_INSTANCE=demo_instance,
    )

    assert "site-packages" in result["sdk"]  # the SDK, not the project's agents app
    assert "raw_response_event" in result["kinds"] and "run_item_stream_event" in result["kinds"]
    assert result["first"] and result["second"]
    assert result["first_id"].startswith("resp_") and result["second_id"] != result["first_id"]
    # The second turn went on from the first, stored by the runtime.
    ((previous,),) = node_server.query(
        "select p.response_id from agents_storedresponse r join agents_storedresponse p on r.previous_id = p.id "
        "where r.response_id = ?",
        result["second_id"],
    )
    assert previous == result["first_id"]


# The same, reading a stream the runtime sent: replayed to the SDK in place of the network, by ``model``.
REPLAYED_MODEL = """
import asyncio, json, sys
import httpx
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
with open(sys.argv[1], "rb") as sent:
    stream = sent.read()

def replay(request):
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

client = AsyncOpenAI(
    api_key="replayed",
    base_url="https://runtime.invalid/v1",
    http_client=httpx.AsyncClient(transport=httpx.MockTransport(replay)),
    max_retries=0,
)
model = OpenAIResponsesModel(model="support.agent", openai_client=client)
"""
AGENTS_SDK_REPLAY_SCRIPT = (
    REPLAYED_MODEL
    + """
async def run():
    agent = Agent(name="Spare parts", model=model)
    result = Runner.run_streamed(agent, "Which belt fits machine 4711?", max_turns=1)
    async for _ in result.stream_events():
        pass
    return {"final": result.final_output, "id": result.last_response_id}

print(json.dumps(asyncio.run(run())))
"""
)


def read_with_the_agents_sdk(stream: str, folder: Path) -> dict[str, object]:
    """What the Agents SDK's streamed run makes of ``stream``: its final output and the response id it keeps."""
    sent = folder / "stream.sse"
    sent.write_text(stream)
    return run_sdk_script(AGENTS_SDK_REPLAY_SCRIPT, str(sent), folder=folder)


AGENTS_SDK_TOOL_REPLAY_SCRIPT = (
    REPLAYED_MODEL
    + """
asked = []

@function_tool
def ask_multiple_choice(question: str, options: list[str]) -> str:
    \"\"\"Ask the user to pick one of the options.\"\"\"
    asked.append(question)
    return "4711"

async def run():
    agent = Agent(name="Spare parts", model=model, tools=[ask_multiple_choice], tool_use_behavior="stop_on_first_tool")
    result = Runner.run_streamed(agent, "Which belt fits my machine?", max_turns=1)
    async for _ in result.stream_events():
        pass
    return {"final": result.final_output, "asked": len(asked)}

print(json.dumps(asyncio.run(run())))
"""
)
ASK = {
    "type": "function",
    "name": "ask_multiple_choice",
    "description": "Ask the user to pick one of the options.",
    "parameters": {
        "type": "object",
        "properties": {"question": {"type": "string"}, "options": {"type": "array", "items": {"type": "string"}}},
        "required": ["question", "options"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.mark.django_db(transaction=True)
async def test_the_agents_sdk_runs_its_own_tool_on_a_turn_that_holds_a_server_tools_call_too(
    tenant: Tenant, spare_parts: AgentInstance, tmp_path: Path
) -> None:
    body = {
        "model": spare_parts.instance_id,
        "input": "Which belt fits my machine? Ask me which machine I have.",
        "stream": True,
        "tools": [ASK],
        "tool_choice": {"type": "function", "name": "ask_multiple_choice"},
        "max_output_tokens": 200,  # the call is closed in time whatever its options run to
    }
    response = await tenant.post("/v1/responses", body, accept="text/event-stream")
    assert response.status_code == 200, response.content
    stream = await read_stream(response)
    final = check_stream(tenant.spec, parse_events(stream))
    assert [item["type"] for item in final["output"]] == [AGENT_CALL, "function_call"]

    sent = tmp_path / "stream.sse"
    sent.write_text(stream)
    read = run_sdk_script(AGENTS_SDK_TOOL_REPLAY_SCRIPT, str(sent), folder=tmp_path)

    # The runner read the server tool's item as a message with no content, and ran its own tool.
    assert read == {"final": "4711", "asked": 1}


@pytest.fixture
def speechless_agent(make_instance: Callable[..., AgentInstance], toy_model: CatalogEntry) -> AgentInstance:  # noqa: F811
    """Searches first, on the toy model given a chat template that leaves it nothing to echo: it says nothing."""
    mute = CatalogEntry.objects.create(
        public_id="b3os/toy-mute",
        runner=toy_model.runner,
        runner_settings={**toy_model.runner_settings, "chat_template": "</s>"},
        context_length=toy_model.context_length,
        max_output_tokens=toy_model.max_output_tokens,
    )
    return make_instance(
        "support.agent.speechless", model=mute, documents=True, tools=["knowledge_search"], first_step=FirstStep.SEARCH
    )


@pytest.mark.django_db(transaction=True)
async def test_the_agents_sdk_reads_a_turn_whose_model_said_nothing_after_the_search_as_an_empty_answer(
    tenant: Tenant, speechless_agent: AgentInstance, tmp_path: Path
) -> None:
    body = {"model": speechless_agent.instance_id, "input": "Which belt fits machine 4711?", "stream": True}
    response = await tenant.post("/v1/responses", body, accept="text/event-stream")
    assert response.status_code == 200, response.content
    stream = await read_stream(response)

    final = check_stream(tenant.spec, parse_events(stream))
    assert (final["status"], final["usage"]["output_tokens"]) == ("completed", 0)
    # The search, then the answer's message, empty: the SDK takes the last message for the answer.
    assert [item["type"] for item in final["output"]] == [AGENT_CALL, "message"] and message_text(final) == ""
    read = read_with_the_agents_sdk(stream, tmp_path)
    assert read == {"final": "", "id": final["id"]}


def test_curl_reads_the_stream_and_rates_the_answer(
    node_server: LiveServer, demo_instance: str, openai_spec: OpenAISpec
) -> None:
    headers = {
        "Authorization": f"Bearer {node_server.key}",
        "X-Tenant-ID": node_server.org,
        "Accept": "text/event-stream",
    }
    body = {"model": demo_instance, "input": "Can you store my credit card?", "stream": True, "store": True}
    with httpx.stream("POST", f"{node_server.url}/v1/responses", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req_")
        events = parse_events(response.read().decode())

    final = check_stream(openai_spec, events)
    assert SeedClient().read(events).refusal == final["output"][0]["content"][1]["refusal"]

    listed = httpx.get(f"{node_server.url}/v1/instances", headers=headers, timeout=30).json()
    assert demo_instance in [instance["id"] for instance in listed["data"]]
    rated = httpx.post(
        f"{node_server.url}/v1/feedback",
        json={"meta": {"message_id": final["id"]}, "rating": "positive", "comment": "Clear."},
        headers=headers,
        timeout=30,
    )
    assert rated.status_code == 200 and rated.json()["message_id"] == final["id"]
    assert node_server.query("SELECT rating, comment FROM agents_feedback") == [("positive", "Clear.")]
    assert json.loads(
        node_server.query("SELECT output_items FROM agents_storedresponse WHERE response_id = ?", final["id"])[0][0]
    )


def test_a_turn_the_client_hangs_up_on_before_its_first_token_is_recorded_with_no_tokens(
    node_server: LiveServer, demo_instance: str
) -> None:
    headers = {"Authorization": f"Bearer {node_server.key}", "X-Tenant-ID": node_server.org}
    # A long question: its prompt takes the model a while to read, and the client is gone before it has.
    question = "Which spare parts fit machine 4711? " + "It is an older model, bought second hand. " * 120
    body = {"model": demo_instance, "input": question, "stream": True, "store": False, "max_output_tokens": 50}
    with (
        httpx.Client(base_url=node_server.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/v1/responses", json=body) as response,
    ):
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["type"] == "response.created"
                break

    rows: list[tuple] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not rows:
        rows = node_server.query(
            "select status, input_tokens, output_tokens, time_to_first_token_ms from inference_usagerecord "
            "where request_id = ?",
            request_id,
        )
        time.sleep(0.2)
    # As a node request that ended so: it consumed nothing that was served.
    assert rows == [(499, 0, 0, None)]


def test_a_client_that_hangs_up_mid_turn_frees_the_model_and_the_turn_is_recorded_and_kept(
    node_server: LiveServer, demo_instance: str
) -> None:
    headers = {"Authorization": f"Bearer {node_server.key}", "X-Tenant-ID": node_server.org}
    body = {
        "model": demo_instance,
        "input": "Describe every spare part of machine 4711 in detail.",
        "stream": True,
        "store": True,
        "max_output_tokens": 2000,
        "temperature": 0,  # the same long answer every run: sampled, one could end before the client hangs up
    }
    with httpx.Client(base_url=node_server.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/responses", json=body) as response:
            request_id = response.headers["x-request-id"]
            deltas, response_id = 0, ""
            for line in response.iter_lines():
                if line.startswith("data: ") and not response_id:
                    response_id = json.loads(line[6:])["response"]["id"]
                deltas += line.startswith("data: ") and "output_text.delta" in line
                if deltas >= 2:
                    break
        # The model serves the next request: the abandoned turn does not hold it (its record, below, shows it did
        # not run on to 2000 tokens).
        quick = http.post(
            "/v1/infer/chat/completions",
            json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
        assert quick.status_code == 200

    rows: list[tuple] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not rows:
        rows = node_server.query(
            "select status, error_code, output_tokens from inference_usagerecord where request_id = ? and endpoint = ?",
            request_id,
            "agents.responses",
        )
        time.sleep(0.2)
    assert rows, "the abandoned turn left no usage record"
    status, error_code, output_tokens = rows[0]
    assert (status, error_code) == (499, "client_disconnected")
    assert 3 <= output_tokens < 2000

    # What was produced is kept, cancelled, and the conversation goes on from it.
    ((status, output, usage),) = node_server.query(
        "select status, output_items, usage from agents_storedresponse where response_id = ?", response_id
    )
    assert status == "cancelled" and json.loads(output)[-1]["type"] == "message"
    # With the tokens it took, as its usage record counts them.
    assert json.loads(usage)["output_tokens"] == output_tokens
    follow = {
        "model": demo_instance,
        "input": "Thanks.",
        "stream": True,
        "previous_response_id": response_id,
        "max_output_tokens": 16,
    }
    with httpx.stream("POST", f"{node_server.url}/v1/responses", json=follow, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert '"response.completed"' in response.read().decode()
