"""Real Responses clients against a live server: the openai SDK, the OpenAI Agents SDK, the Codex CLI with the
README's configuration, a request shaped like Codex's, and a WebSocket upgrade on a raw socket."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.conftest import MODEL_ID, LiveServer, OpenAISpec, run_sdk_script
from tests.inference.test_responses import check_stream, parse_events

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def client(node_server: LiveServer) -> OpenAI:
    return OpenAI(api_key=node_server.key, base_url=node_server.base_url, max_retries=0, timeout=120)


def test_the_sdk_creates_a_response(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_ID,
        instructions="You are a concise assistant.",
        input="Name one river in Oregon.",
        max_output_tokens=24,
        temperature=0,
    )

    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_the_sdk_counts_a_requests_input_tokens_as_its_response_counts_them(
    client: OpenAI, openai_spec: OpenAISpec
) -> None:
    asked = {"model": MODEL_ID, "instructions": "Be brief.", "input": "Name one river in Oregon.", "tools": [WEATHER]}

    counted = client.responses.input_tokens.count(**asked)  # type: ignore[arg-type]
    response = client.responses.create(**asked, max_output_tokens=16, temperature=0)  # type: ignore[call-overload]

    openai_spec.validate("TokenCountsResource", counted.model_dump())
    assert response.usage is not None and counted.input_tokens == response.usage.input_tokens


def test_the_sdk_stream_helper_reads_the_event_stream(client: OpenAI) -> None:
    # A short answer: the helper's final response needs response.completed, not response.incomplete.
    with client.responses.stream(model=MODEL_ID, input="Say hello.", max_output_tokens=48, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()

    assert deltas and "".join(deltas) == final.output_text
    assert final.status == "completed" and final.usage is not None


def test_the_sdk_parses_structured_output_into_a_pydantic_model(client: OpenAI) -> None:
    class Verdict(BaseModel):
        is_a_river: bool

    response = client.responses.parse(
        model=MODEL_ID, input="Is the Willamette a river?", text_format=Verdict, max_output_tokens=32, temperature=0
    )

    assert isinstance(response.output_parsed, Verdict)


def test_a_function_tool_round_trip_as_the_docs_show_it(client: OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Eugene, Oregon? Use the tool."}
    # The docs leave tool_choice at auto; SmolLM2 needs it forced to call reliably.
    first = client.responses.create(
        model=MODEL_ID, input=[question], tools=[WEATHER], tool_choice="required", max_output_tokens=48, temperature=0
    )
    call = next(o for o in first.output if o.type == "function_call")
    assert json.loads(call.arguments)["city"]
    follow = [
        question,
        *[o.model_dump(exclude_unset=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "52F and raining"},
    ]

    answer = client.responses.create(model=MODEL_ID, input=follow, tools=[WEATHER], max_output_tokens=32, temperature=0)

    assert answer.output and answer.status in ("completed", "incomplete")
    assert answer.tools[0].strict is None


# The OpenAI Agents SDK is imported as ``agents``, which in this project's directory is the agent runtime app:
# the SDK runs in a process of its own, with the project off its path (-P, and a directory outside the project).
AGENTS_SDK_SCRIPT = """
import asyncio, json, os
import agents
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
calls = []

@function_tool
def get_weather(city: str) -> str:
    \"\"\"Current weather for a city.\"\"\"
    calls.append(city)
    return "52F and raining"

async def run():
    client = AsyncOpenAI(api_key=os.environ["B3OS_KEY"], base_url=os.environ["B3OS_BASE_URL"], max_retries=0)
    agent = Agent(
        name="Weather",
        instructions="Answer with the tool's result.",
        model=OpenAIResponsesModel(model=os.environ["B3OS_MODEL"], openai_client=client),
        tools=[get_weather],
        # SmolLM2 calls reliably only when forced; one model turn keeps the test fast.
        model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    # Streamed, so the SDK reads the function call from the event stream.
    result = Runner.run_streamed(agent, "What is the weather in Eugene, Oregon? Use the tool.")
    kinds = [event.type async for event in result.stream_events()]
    return {"sdk": agents.__file__, "calls": calls, "final_output": result.final_output, "kinds": kinds}

print(json.dumps(asyncio.run(run())))
"""


def test_the_agents_sdk_runs_a_function_tool(node_server: LiveServer, tmp_path: Path) -> None:
    result = run_sdk_script(
        AGENTS_SDK_SCRIPT,
        folder=tmp_path,
        B3OS_KEY=node_server.key,
        B3OS_BASE_URL=node_server.base_url,
        B3OS_MODEL=MODEL_ID,
    )

    assert "site-packages" in result["sdk"]  # the SDK, not the project's agents app
    assert result["calls"] and result["final_output"] == "52F and raining"
    assert "raw_response_event" in result["kinds"] and "run_item_stream_event" in result["kinds"]


# Installed by `make test` (the Makefile pins the release).
CODEX = ROOT / "var" / "codex" / "node_modules" / ".bin" / "codex"
README_BASE_URL = "http://127.0.0.1:8000/v1/infer"


def readme_codex_config(base_url: str) -> str:
    """The README's Codex configuration, pointed at ``base_url``: the test runs what users are told to write."""
    (config,) = re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert README_BASE_URL in config
    return config.replace(README_BASE_URL, base_url)


@pytest.mark.timeout(900)
def test_codex_exec_answers_with_the_readmes_configuration(node_server: LiveServer, tmp_path: Path) -> None:
    if not CODEX.exists():
        pytest.fail(f"the Codex CLI is not installed at {CODEX}: `make test` installs it")
    home, work, answer = tmp_path / "codex-home", tmp_path / "work", tmp_path / "answer.txt"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(readme_codex_config(node_server.base_url))
    # Codex sends no temperature, so SmolLM2 samples at 1, and about one free answer in three runs on to the end of
    # the context (an incomplete response, to Codex). An answer held to a short JSON object always ends.
    schema = {
        "type": "object",
        "properties": {"greeting": {"type": "string", "minLength": 1, "maxLength": 80}},
        "required": ["greeting"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home), "B3OS_API_KEY": node_server.key}
    # Codex resends its ~6,300-token prefix every turn, which the CPU runner reads in 1 to 3.5 minutes on a busy 2-core
    # machine, with no event in between: Codex waits up to 13 minutes for one. No retries: a failure shows at once, not
    # after five more prefills.
    provider = "model_providers.b3os"
    patience = ["-c", f"{provider}.stream_idle_timeout_ms=780000"]
    patience += ["-c", f"{provider}.request_max_retries=0", "-c", f"{provider}.stream_max_retries=0"]
    run = subprocess.run(
        [
            str(CODEX), "exec", *patience, "--skip-git-repo-check", "--output-schema", str(tmp_path / "schema.json"),
            "--output-last-message", str(answer), "Say hello.",
        ],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=840,
    )  # fmt: skip

    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(answer.read_text())["greeting"]
    assert run.stdout.strip() == answer.read_text().strip()


def test_a_request_shaped_like_codexs_streams_valid_events(node_server: LiveServer, openai_spec: OpenAISpec) -> None:
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    body = {
        "model": MODEL_ID,
        "instructions": "You are a coding agent. Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_ls"},
            {"type": "function_call_output", "call_id": "call_ls", "output": "README.md\nsrc"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "README.md and src."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Thanks. Which is the readme?"}],
            },
        ],
        "tools": [shell],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "3f1c2a4e-codex-session",
        "client_metadata": {"session_id": "3f1c2a4e-codex-session", "x-codex-turn-metadata": '{"request_kind":"turn"}'},
        "max_output_tokens": 32,  # Codex sends none; this keeps the test short
    }
    headers = {"Authorization": f"Bearer {node_server.key}"}
    with httpx.stream("POST", f"{node_server.base_url}/responses", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        events = parse_events(response.read().decode())

    final = check_stream(openai_spec, events)
    assert final["store"] is False and final["parallel_tool_calls"] is False and final["tools"][0]["strict"] is False


def test_a_websocket_upgrade_is_answered_at_once_with_405(node_server: LiveServer) -> None:
    url = urlparse(node_server.base_url)
    request = (
        f"GET {url.path}/responses HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {node_server.key}\r\n"
        "\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection without answering"
            head += chunk

    status, *header_lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in header_lines)}
    assert status.split(" ")[1] == "405"
    assert headers["allow"] == "POST"
