"""deploy/ stays true to the code: the compose file and Prometheus config pass their own tools, every node's
compose command passes `swarmnode run --dry-run`, and a real Prometheus scraping a real three-node swarm
answers every expression of the Grafana dashboard with a series for every node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from swarmnode.bench.procs import free_port
from swarmnode.util.metrics import Metrics
from swarmtest import start_swarm, wait_for

pytestmark = pytest.mark.timeout(120)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
DATASOURCE = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER = DEPLOY / "grafana" / "provisioning" / "dashboards" / "swarmnode.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "swarmnode.json"

# What Grafana puts in for its variables; 30 s spans enough 1 s scrapes for rate() and a few rounds.
GRAFANA_VARIABLES = {"__rate_interval": "30s", "__interval": "1s", "__range": "5m"}
SWARM = (
    "--run-id",
    "deploy",
    "--inner-steps",
    "20",
    "--hot-every",
    "5",
    "--cold-every",
    "1",
    "--wait-peers",
    "2",
    "--matchmaking-timeout",
    "5",
    "--max-outer-steps",
    "1000",
    "--seed",
    "3",
)


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"`{tool}` is not installed here (CI installs it: see .ci/run)")
    return path


# ----- the files -----


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def image_entrypoint() -> list[str]:
    (entrypoint,) = [args for instr, args in dockerfile_instructions() if instr == "ENTRYPOINT"]
    return json.loads(entrypoint)


def image_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, args in dockerfile_instructions():
        if instr == "ENV":
            env.update(item.partition("=")[::2] for item in shlex.split(args))
    return env


def compose_services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def swarmnode_services() -> dict[str, dict[str, Any]]:
    """The services built from deploy/Dockerfile."""
    return {name: s for name, s in compose_services().items() if "build" in s}


def as_argv(value: str | list[Any]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def dashboard_panels() -> list[dict[str, Any]]:
    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def with_grafana_variables(expr: str) -> str:
    return re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: GRAFANA_VARIABLES[m.group(1) or m.group(2)], expr)


# ----- the files against their tools and the CLI -----


def test_compose_file_passes_docker_compose_config() -> None:
    out = subprocess.run(
        [require("docker-compose"), "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_prometheus_config_passes_promtool() -> None:
    out = subprocess.run(
        [require("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_runs_three_nodes_prometheus_and_grafana() -> None:
    services = compose_services()
    nodes = swarmnode_services()
    assert {"node1", "node2", "node3"} <= set(nodes)
    assert {"prometheus", "grafana"} <= set(services)
    volumes = [v for s in nodes.values() for v in s["volumes"] if v.endswith(":/data")]
    assert len(volumes) == len(nodes) == len(set(volumes)), "each node needs its own /data volume"
    assert all("healthcheck" in s for s in nodes.values())
    assert any(v.startswith("./prometheus.yml:") for v in services["prometheus"]["volumes"])
    for kind in ("datasources", "dashboards"):
        mount = f"./grafana/provisioning/{kind}:/etc/grafana/provisioning/{kind}:ro"
        assert mount in services["grafana"]["volumes"]
    prometheus = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:9464" for name in nodes}


@pytest.mark.parametrize("name", sorted(swarmnode_services()))
def test_compose_node_command_is_accepted_by_swarmnode_run(name: str) -> None:
    service = swarmnode_services()[name]
    argv = [*as_argv(service.get("entrypoint", image_entrypoint())), *as_argv(service["command"])]
    assert argv[:2] == ["swarmnode", "run"], argv
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMNODE_")}
    env.update(image_environment())
    env.update(compose_environment(service))
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", *argv[1:], "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, f"{name}: {out.stderr}"
    cfg = json.loads(out.stdout)
    assert cfg["advertise_host"] == name
    assert cfg["data_dir"] == "/data"
    assert (cfg["grpc_port"], cfg["dht_port"], cfg["metrics_port"]) == (50051, 8468, 9464)
    assert cfg["peers"] == ([] if name == "node1" else ["node1:8468"])
    assert cfg["wait_peers"] == len(swarmnode_services()) - 1


def test_dashboard_uses_the_provisioned_datasource_and_existing_metrics() -> None:
    (datasource,) = yaml.safe_load(DATASOURCE.read_text())["datasources"]
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDER.read_text())["providers"]
    grafana = compose_services()["grafana"]
    assert any(v.endswith(":" + provider["options"]["path"] + ":ro") for v in grafana["volumes"])
    exposed = set(re.findall(r"^(swarmnode_\w+)", generate_latest(Metrics().registry).decode(), re.M))
    for panel in dashboard_panels():
        for target in [panel, *panel.get("targets", [])]:
            if "datasource" in target:
                assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
    for expr in dashboard_exprs():
        assert set(re.findall(r"swarmnode_\w+", expr)) <= exposed, expr
        assert set(re.findall(r"\$\{?(\w+)", expr)) <= set(GRAFANA_VARIABLES), expr


def test_dashboard_aggregations_keep_one_series_per_node() -> None:
    for expr in dashboard_exprs():
        for op, labels in re.findall(
            r"\b(sum|avg|min|max|count|topk|bottomk)\s*(?:by\s*\(([^)]*)\))?\s*\(", expr
        ):
            assert "instance" in labels.replace(" ", "").split(","), f"{op} drops the instance: {expr}"


# ----- a real Prometheus scraping a real swarm -----


def prometheus_query(base_url: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)["data"]["result"]
    except urllib.error.HTTPError as exc:  # a bad expression: fail now, not at the deadline
        raise AssertionError(f"Prometheus refused {expr!r}: {exc.read().decode(errors='replace')}") from None


def prometheus_ready(base_url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
    try:
        with urllib.request.urlopen(f"{base_url}/-/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_prometheus(targets: list[str]) -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    """deploy/prometheus.yml with these targets and a 1 s scrape interval, in a real `prometheus`;
    yields its instant-query function and kills it (and its storage) on the way out."""
    binary = require("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": targets}]
    with tempfile.TemporaryDirectory(prefix="swarmnode-prometheus-") as workdir:
        config_path = Path(workdir) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        base_url = f"http://127.0.0.1:{free_port()}"
        log_path = Path(workdir) / "prometheus.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir}/data",
                    f"--web.listen-address={base_url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            try:
                wait_for(lambda: prometheus_ready(base_url, proc), 30, "Prometheus to be ready", 0.2)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{log_path.read_text(errors='replace')[-3000:]}") from None
            yield lambda expr: prometheus_query(base_url, expr)
        finally:
            proc.kill()
            proc.wait(10)


def nodes_lacking(
    query: Callable[[str], list[dict[str, Any]]], exprs: list[str], instances: set[str]
) -> dict[str, list[str]]:
    """expression -> the instances it returns no number for (NaN, e.g. a quantile of nothing, does not
    count); only expressions that lack some."""
    lacking = {}
    for expr in exprs:
        result = query(with_grafana_variables(expr))
        returned = {s["metric"].get("instance") for s in result if s["value"][1].lower() != "nan"}
        if instances - returned:
            lacking[expr] = sorted(instances - returned)
    return lacking


def test_real_prometheus_answers_every_dashboard_expression_for_every_node(tmp_path: Path, reaper) -> None:
    require("prometheus")
    exprs = dashboard_exprs()
    nodes = start_swarm(reaper, tmp_path, 3, SWARM)
    try:
        instances = {f"127.0.0.1:{node.info['metrics_port']}" for node in nodes}
        with running_prometheus(sorted(instances)) as query:
            lacking: dict[str, list[str]] = {}

            def complete() -> bool:
                lacking.clear()
                lacking.update(nodes_lacking(query, exprs, instances))
                return not lacking

            try:
                wait_for(complete, 60, "every dashboard expression to return a series per node", 1.0)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; still lacking: {json.dumps(lacking, indent=1)}") from None
        for node in nodes:
            assert node.proc is not None and node.proc.poll() is None, node.log()[-3000:]
    finally:
        for node in nodes:
            node.signal(signal.SIGTERM)
        for node in nodes:
            with contextlib.suppress(AssertionError):  # the reaper kills what does not leave in time
                node.wait(30)
