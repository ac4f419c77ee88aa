"""deploy/'s files agree with each other and with what the node exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.topology import DEPLOY, GATEWAY_MODEL, Topology, env_example_names, procfile_names
from tests.deploy.traffic import MODEL

# Set by honcho for each process, not by the operator.
HONCHO_SETS = {"PORT"}
# Added by Prometheus to every series it scrapes.
PROMETHEUS_LABELS = {"job", "instance"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}

pytestmark = pytest.mark.distributed


def variables(text: str) -> set[str]:
    """The environment variables a file reads, its comments left out."""
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", code))


def test_every_variable_the_procfile_and_haproxy_read_is_in_the_env_example() -> None:
    read = variables((DEPLOY / "Procfile").read_text()) | variables((DEPLOY / "haproxy.cfg").read_text())

    assert read - HONCHO_SETS <= set(env_example_names())


def test_the_procfile_runs_the_api_workers_beat_and_the_balancer() -> None:
    assert procfile_names() == ["api1", "api2", "smollm2", "beat", "housekeeping", "lb"]


def test_every_procfile_line_replaces_its_shell_with_its_program() -> None:
    # Units from `honcho export systemd` run each line with `sh -lc` and stop only the main process: without exec,
    # the shell went and its program stayed, holding its port.
    lines = (DEPLOY / "Procfile").read_text().splitlines()
    commands = [line.split(":", 1)[1].strip() for line in lines if re.match(r"^[A-Za-z0-9_-]+:", line)]

    assert len(commands) == len(procfile_names())
    assert all(command.startswith("exec ") for command in commands)


def test_haproxy_accepts_its_configuration_with_the_example_environment() -> None:
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: `make test` installs it")
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if re.match(r"^[A-Z_0-9]+=", line)
    )

    checked = subprocess.run(
        ["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")],
        env={"PATH": os.environ["PATH"], **example},
        capture_output=True,
        text=True,
    )

    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_prometheus_scrapes_each_api_process_of_the_example() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if re.match(r"^[A-Z_0-9]+=", line)
    )

    api = next(job for job in config["scrape_configs"] if job["job_name"] == "b3os-api")

    assert api["metrics_path"] == "/metrics"
    assert api["static_configs"][0]["targets"] == [
        f"{example['API_HOST']}:{example['API_1_PORT']}",
        f"{example['API_HOST']}:{example['API_2_PORT']}",
    ]


# --- the dashboard against a running server -----------------------------------------------------------------


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def test_every_dashboard_panel_reads_only_the_jobs_chosen_above_it() -> None:
    # Most panels left the dashboard's job variable out and summed every job Prometheus scrapes.
    dashboard = json.loads((DEPLOY / "grafana" / "b3os.json").read_text())
    panels = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]

    for query in panels:
        assert queried_series(query), query
        assert all("job" in labels for _, labels in queried_series(query)), query


def queried_series(query: str) -> list[tuple[str, set[str]]]:
    """Each metric a PromQL query reads, with the labels it selects or groups that metric by."""
    query = re.sub(r'"[^"]*"', '""', query)  # label values are data, not names
    grouped = {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", query) for label in group.split(",")}
    found = []
    for match in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{([^}]*)\}|\[|,|\))", query):
        name = match.group(1)
        if name in PROMQL_WORDS or name in grouped or "_" not in name:
            continue
        selected = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", match.group(3) or ""))
        found.append((name, selected | grouped))
    return found


def exported(text: str) -> dict[str, set[str]]:
    """Every sample name in a /metrics page, with the label names its samples carry."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        name = name.split(" ")[0]
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', rest)) if rest else set()
        series.setdefault(name, set()).update(labels)
    return series


def test_every_metric_the_dashboard_queries_is_exported_with_its_labels(topology: Topology) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "b3os.json").read_text())
    # Labelled series appear once something happened: a generation, a gateway request, a refusal.
    key = topology.organization("dashboard", "--rpm", "1")
    api = topology.api_url(1) + "/v1/infer/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    assert httpx.post(api, json=ask, headers=headers, timeout=60).status_code == 200
    gateway = {"model": GATEWAY_MODEL, "route": "gateway", "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(api, json=gateway, headers=headers, timeout=60).status_code == 200
    assert httpx.post(api, json=ask, headers=headers, timeout=60).status_code == 429

    series = exported(httpx.get(topology.api_url(1) + "/metrics", timeout=10).text)

    queried = [(name, labels) for query in dashboard_queries(dashboard) for name, labels in queried_series(query)]
    assert {name for name, _ in queried} >= {
        "b3os_requests_total",
        "b3os_tokens_total",
        "b3os_time_to_first_token_seconds_bucket",
        "b3os_request_duration_seconds_bucket",
        "b3os_requests_in_flight",
        "b3os_rejected_requests_total",
    }
    missing = sorted({name for name, _ in queried if name not in series})
    assert missing == []
    unlabelled = sorted(
        {
            (name, label)
            for name, labels in queried
            for label in labels - PROMETHEUS_LABELS - {"le"}
            if label not in series[name]
        }
    )
    assert unlabelled == []
