"""The deploy files keep the code's promises (no Docker engine runs here: they are read).

* grace periods above the code's shutdown ceilings (handoff 20 s; the gateway's budget);
* one image, exec-form entrypoint, non-root, multi-stage;
* every probe and healthcheck hits an endpoint that exists (the gateway's OpenAPI
  routes, the worker health server's routes);
* Postgres connections: replicas x pool size fit within max_connections;
* every long-running koda process (gateway, workers, schedulers, the compactor) runs
  with its probes and is scraped for /metrics, in compose and in k8s;
* compose's Prometheus keeps exemplars and its Grafana links them to Jaeger.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from koda_runtime.errors import ConfigError
from koda_runtime.gateway.app import create_app
from koda_runtime.gateway.bootstrap import DRAIN_TIMEOUT_S, FLUSH_TIMEOUT_S
from koda_runtime.gateway.server import GRACEFUL_SHUTDOWN_S
from koda_runtime.naming import AppEnv
from koda_runtime.processors.compactor import ROUTES as COMPACTOR_ROUTES
from koda_runtime.processors.health import ROUTES as WORKER_ROUTES
from koda_runtime.scheduler.bootstrap import ROUTES as SCHEDULER_ROUTES
from koda_runtime.schemas.db import async_engine
from koda_runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEFAULTS = Settings(app_env=AppEnv.DEV)
GATEWAY_SHUTDOWN_S = GRACEFUL_SHUTDOWN_S + DRAIN_TIMEOUT_S + FLUSH_TIMEOUT_S
# Postgres keeps superuser_reserved_connections (default 3) out of everyone's reach, and
# `koda db upgrade` holds at most 2 while it runs (it may overlap a rolling deploy).
PG_RESERVED = 3
MIGRATE_CONNECTIONS = 2


def seconds(value: str | int) -> float:
    if isinstance(value, int):
        return float(value)
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", value)
    assert match and value, f"unparsable duration {value!r}"
    return int(match.group(1) or 0) * 60.0 + int(match.group(2) or 0)


def gateway_paths() -> set[str]:
    """The gateway's documented routes (``/openapi.json``)."""
    return set(create_app(DEFAULTS).openapi()["paths"])


def gateway_routes() -> set[str]:
    """Every route the gateway serves (``/metrics`` is left out of OpenAPI)."""
    paths: set[str] = set()

    def walk(routes: list[Any]) -> None:
        for route in routes:
            if isinstance(getattr(route, "path", None), str):
                paths.add(route.path)
            inner = getattr(route, "original_router", None)  # FastAPI's included routers
            if inner is not None:
                walk(list(inner.routes))

    walk(list(create_app(DEFAULTS).routes))
    return paths


def pool_sizes() -> tuple[int, int]:
    """(worker, gateway) connection pool sizes, as the code builds them (no I/O)."""
    from koda_runtime.processors.bootstrap import build_worker

    settings = Settings(app_env=AppEnv.DEV, namespace="unit")
    sizes = set()
    # The worker's pool does not grow with the runs it executes.
    for max_inflight in (settings.max_inflight, 4096):
        with tempfile.TemporaryDirectory() as datadir:
            built = Settings(app_env=AppEnv.DEV, namespace="unit", max_inflight=max_inflight)
            pool = build_worker(built, datadir).store.engine.pool
            sizes.add(pool.size() + pool._max_overflow)  # type: ignore[attr-defined]
    assert len(sizes) == 1, sizes
    worker = sizes.pop()
    engine = async_engine(settings)
    gateway = engine.pool.size() + engine.pool._max_overflow  # type: ignore[attr-defined]
    return worker, gateway


def scheduler_pool() -> int:
    """A scheduler replica's pool size, as scheduler/app.py builds it."""
    from koda_runtime.scheduler.bootstrap import POOL_SIZE

    engine = async_engine(DEFAULTS, pool_size=POOL_SIZE)
    return engine.pool.size() + engine.pool._max_overflow  # type: ignore[attr-defined]


def compactor_pool() -> int:
    """The compactor's pool bound, as processors/compactor.py builds its engine (no I/O)."""
    from koda_runtime.processors.compactor import ChunkCompactor

    engine = ChunkCompactor(DEFAULTS, producer=object()).engine  # type: ignore[arg-type]
    return engine.pool.size() + engine.pool._max_overflow  # type: ignore[attr-defined]


def webhooks_pool() -> int:
    """A webhook dispatcher's pool size, as processors/webhooks.py builds it."""
    from koda_runtime.processors.webhooks import POOL_SIZE

    engine = async_engine(DEFAULTS, pool_size=POOL_SIZE)
    return engine.pool.size() + engine.pool._max_overflow  # type: ignore[attr-defined]


def option(args: list[str], name: str) -> str:
    """The value of the last ``name`` option in ``args`` (click keeps the last one)."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    assert values, (name, args)
    return values[-1]


def health_path(test: list[str]) -> str:
    """The URL path a Python urllib healthcheck command requests."""
    match = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(test))
    assert match, test
    return match.group(2)


# --- Dockerfile -----------------------------------------------------------------


def test_one_image_multi_stage_non_root_exec_form_python_as_pid_1() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert sum(1 for line in instructions if line.startswith("FROM ")) >= 2
    user = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    (entry,) = [line for line in instructions if line.startswith("ENTRYPOINT ")]
    argv = json.loads(entry.removeprefix("ENTRYPOINT "))  # exec form is a JSON array
    assert argv[0].endswith("python") and argv[1:] == ["-m", "koda_runtime.cli", "entrypoint"]
    assert not [
        line
        for line in instructions
        if line.startswith("CMD ") and not line.removeprefix("CMD ").startswith("[")
    ]
    assert "tini" not in text and "dumb-init" not in text  # nothing between us and PID 1


# --- compose ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_runs_kraft_postgres_jobs_gateway_workers_and_prometheus(compose) -> None:
    services = compose["services"]
    assert set(services) >= {
        "kafka",
        "postgres",
        "migrate",
        "topics",
        "gateway",
        "worker",
        "scheduler",
        "compactor",
        "webhooks",
        "prometheus",
    }
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    # Migration 0009 needs pgvector: the stock postgres image lacks it.
    assert services["postgres"]["image"].startswith("pgvector/pgvector:pg18")
    assert services["postgres"]["volumes"] == ["pg-data:/var/lib/postgresql"]
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert "zookeeper" not in json.dumps(services).lower()
    for job in ("migrate", "topics"):
        assert services[job]["restart"] == "no"
    roles = {name: s.get("environment", {}).get("ROLE") for name, s in services.items()}
    assert {roles["migrate"], roles["topics"], roles["gateway"], roles["worker"]} == {
        "migrate",
        "topics",
        "gateway",
        "worker",
    }
    for name in ("gateway", "worker"):
        deps = services[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully"
        assert deps["topics"]["condition"] == "service_completed_successfully"
        assert services[name]["image"] == services["migrate"]["image"]  # one image
    assert services["worker"]["deploy"]["replicas"] == 3
    assert services["topics"]["command"] == ["--confirm-prod"]


def test_compose_replicas_make_up_their_own_worker_ids(compose) -> None:
    worker = compose["services"]["worker"]
    assert worker["deploy"]["replicas"] > 1
    env = {**compose["x-koda"]["environment"], **worker["environment"]}
    # One id for three replicas would make them one worker to the heartbeat table.
    assert "KODA_WORKER_ID" not in env
    assert env.get("KODA_STATIC_MEMBERSHIP", "false") == "false"


def test_compose_publishes_the_gateway_on_loopback_only(compose) -> None:
    """Dev mode lets any ``dev:<user>`` token be that user and opens /admin: the
    published port must not reach other hosts (Docker binds 0.0.0.0 without an address)."""
    published = [
        (name, port) for name, s in compose["services"].items() for port in s.get("ports", [])
    ]
    assert ("gateway", "127.0.0.1:8080:8080") in published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), (name, port)


def test_compose_grace_periods_exceed_the_code_ceilings(compose) -> None:
    services = compose["services"]
    worker_grace = seconds(services["worker"]["stop_grace_period"])
    assert worker_grace == 25 and worker_grace > DEFAULTS.handoff_ceiling_s
    assert seconds(services["gateway"]["stop_grace_period"]) > GATEWAY_SHUTDOWN_S
    assert "init" not in services["worker"] and "init" not in services["gateway"]


def test_compose_healthchecks_use_endpoints_that_exist(compose) -> None:
    services = compose["services"]
    assert health_path(services["gateway"]["healthcheck"]["test"]) in gateway_paths()
    assert health_path(services["worker"]["healthcheck"]["test"]) in WORKER_ROUTES
    assert health_path(services["compactor"]["healthcheck"]["test"]) == "/livez"
    assert "/livez" in COMPACTOR_ROUTES
    scheduler = services["scheduler"]
    assert health_path(scheduler["healthcheck"]["test"]) == "/livez" in SCHEDULER_ROUTES
    port = scheduler["environment"]["KODA_SCHEDULER_PORT"]
    assert f"127.0.0.1:{port}/livez" in " ".join(scheduler["healthcheck"]["test"])


def test_compose_prometheus_keeps_exemplars_and_grafana_links_them_to_jaeger(compose) -> None:
    """The run-latency exemplars (trace ids) reach Prometheus only over OpenMetrics and are
    kept only with exemplar storage on; Grafana gets the dashboard and both datasources."""
    services = compose["services"]
    command = services["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    mounted = {m.split(":")[1] for m in services["prometheus"]["volumes"]}
    (config_flag,) = [c for c in command if c.startswith("--config.file=")]
    assert config_flag.split("=", 1)[1] in mounted
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["global"]["scrape_protocols"][0] == "OpenMetricsText1.0.0"
    grafana = services["grafana"]
    mounts = dict(m.rsplit(":", 1)[0].split(":", 1) for m in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert (DEPLOY / "grafana" / "provisioning" / "datasources").is_dir()
    dashboards = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "koda.yaml").read_text()
    )
    (provider,) = dashboards["providers"]
    assert mounts["./grafana/koda.json"] == provider["options"]["path"] + "/koda.json"
    datasources = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "koda.yaml").read_text()
    )
    urls = {d["type"]: d["url"] for d in datasources["datasources"]}
    assert urls == {"prometheus": "http://prometheus:9090", "jaeger": "http://jaeger:16686"}
    assert {"prometheus", "jaeger"} <= set(services)


def dockerfile_env() -> dict[str, str]:
    """The image's ENV (``KEY=VALUE`` pairs of its ENV instructions)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = [p for line in text.splitlines() if line.startswith("ENV ") for p in line.split()[1:]]
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def compose_metrics_ports(compose: dict[str, Any]) -> dict[str, int]:
    """Each long-running koda service's /metrics port, as its process reads it."""
    image_env = dockerfile_env()
    ports = {}
    for name, service in compose["services"].items():
        env = {**image_env, **compose["x-koda"]["environment"], **service.get("environment", {})}
        role = env.get("ROLE")
        if role == "gateway":
            ports[name] = int(env.get("KODA_GATEWAY_PORT", DEFAULTS.gateway_port))
        elif role == "worker":
            ports[name] = int(env["KODA_WORKER_PORT"])
        elif role == "scheduler":
            ports[name] = int(env.get("KODA_SCHEDULER_PORT", 0))
        elif role in ("compactor", "webhooks"):
            ports[name] = int(option(service["command"], "--port"))
        else:
            assert role in (None, "migrate", "topics"), (name, role)
    return ports


def test_compose_runs_the_compactor_as_its_own_role(compose) -> None:
    compactor = compose["services"]["compactor"]
    assert compactor["environment"]["ROLE"] == "compactor"
    assert compactor["image"] == compose["services"]["migrate"]["image"]
    assert compactor.get("deploy", {}).get("replicas", 1) == 1
    assert compactor["restart"] == "unless-stopped"
    port = int(option(compactor["command"], "--port"))
    assert f"127.0.0.1:{port}/livez" in " ".join(compactor["healthcheck"]["test"])
    for dep in ("migrate", "topics"):
        assert compactor["depends_on"][dep]["condition"] == "service_completed_successfully"


def test_prometheus_scrapes_every_koda_process(compose) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert "/metrics" in gateway_routes() and "/metrics" in WORKER_ROUTES
    assert "/metrics" in COMPACTOR_ROUTES
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())
    static = {
        tuple(t.split(":"))
        for j in jobs.values()
        for c in j.get("static_configs", [])
        for t in c["targets"]
    }
    dns = {
        (n, str(c["port"]))
        for j in jobs.values()
        for c in j.get("dns_sd_configs", [])
        for n in c["names"]
    }
    ports = compose_metrics_ports(compose)
    assert set(ports) == {"gateway", "worker", "scheduler", "compactor", "webhooks"}
    for name, port in ports.items():
        assert port > 0, f"{name} serves no /metrics"
        # Several replicas: through Docker's DNS, which answers each replica's address.
        several = compose["services"][name].get("deploy", {}).get("replicas", 1) > 1
        assert (name, str(port)) in (dns if several else static | dns), f"{name}:{port}"
    mounts = compose["services"]["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus.yml:") for m in mounts)


def test_the_image_exposes_every_port_a_role_serves(compose) -> None:
    exposed = {
        int(p)
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("EXPOSE ")
        for p in line.split()[1:]
    }
    assert set(compose_metrics_ports(compose).values()) <= exposed


def test_compose_connections_fit_postgres(compose) -> None:
    services = compose["services"]
    command = services["postgres"]["command"]
    max_connections = int(command[command.index("-c") + 1].split("=")[1])
    worker_pool, gateway_pool = pool_sizes()
    # The pools are the default ones (the sum below is counted with those).
    assert "KODA_DB_POOL" not in services["worker"]["environment"]
    gateways = services["gateway"].get("deploy", {}).get("replicas", 1)
    scheduler = services["scheduler"]
    assert scheduler["environment"]["ROLE"] == "scheduler"
    needed = (
        services["worker"]["deploy"]["replicas"] * worker_pool
        + gateways * gateway_pool
        + scheduler["deploy"]["replicas"] * scheduler_pool()
        + services["compactor"].get("deploy", {}).get("replicas", 1) * compactor_pool()
        + services["webhooks"].get("deploy", {}).get("replicas", 1) * webhooks_pool()
        + MIGRATE_CONNECTIONS
    )
    assert needed <= max_connections - PG_RESERVED, (needed, max_connections)


# --- kubernetes -------------------------------------------------------------------


K8S = DEPLOY / "k8s"
SECRET_EXAMPLE = K8S / "secret.example.yaml"


def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return loaded


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    """What ``kubectl apply -k deploy/k8s`` applies: the kustomization's resources."""
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


@pytest.fixture(scope="module")
def secret_example() -> dict[str, str]:
    """The keys of the Secret koda-secrets, with placeholder values (not applied)."""
    (doc,) = [d for d in yaml.safe_load_all(SECRET_EXAMPLE.read_text()) if d]
    assert (doc["kind"], doc["metadata"]["name"]) == ("Secret", "koda-secrets")
    data: dict[str, str] = doc["stringData"]
    return data


def real_secret(example: dict[str, str]) -> dict[str, str]:
    """The example's keys with generated values where it has placeholders, as an
    operator would create the Secret (a token and a user per API token)."""
    counter = iter(range(1000))

    def generated(_: re.Match[str]) -> str:
        return f"{next(counter):03d}" + "0123456789abcdef" * 4

    return {k: re.sub(r"REPLACE_ME\w*", generated, v) for k, v in example.items()}


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def probe_path(c: dict[str, Any], kind: str) -> str:
    return str(c[kind]["httpGet"]["path"])


def test_k8s_has_the_expected_objects(k8s) -> None:
    kinds = {kind for kind, _ in k8s}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Job"} <= kinds
    services = [doc for (kind, _), doc in k8s.items() if kind == "Service"]
    assert [s["spec"]["selector"]["app.kubernetes.io/component"] for s in services] == ["gateway"]
    # Every manifest is applied, except the example Secret.
    assert sorted(kustomization()["resources"]) == sorted(
        p.name
        for p in K8S.glob("*.yaml")
        if p.name not in ("kustomization.yaml", SECRET_EXAMPLE.name)
    )


def test_kubectl_apply_k_never_applies_a_secret_or_a_placeholder(k8s, secret_example) -> None:
    """``kubectl apply -k`` would deploy placeholders (which prod refuses, so nothing
    starts) and overwrite a Secret created out of band: no Secret is a resource."""
    kustomize = kustomization()
    assert SECRET_EXAMPLE.name not in kustomize["resources"]
    assert not {"secretGenerator", "generators", "components", "bases"} & set(kustomize)
    assert all(kind != "Secret" for kind, _ in k8s)
    for name in kustomize["resources"]:
        assert "REPLACE_ME" not in (K8S / name).read_text(), name
    # The pods still read the Secret the example describes.
    assert {"KODA_DATABASE_URL", "KODA_API_TOKENS", "KODA_ADMIN_TOKEN"} <= set(secret_example)


def test_k8s_worker_grace_probes_and_identity(k8s, secret_example) -> None:
    worker = k8s[("Deployment", "koda-worker")]
    spec = worker["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 25 > DEFAULTS.handoff_ceiling_s
    c = container(worker)
    env = {e["name"]: e for e in c["env"]}
    assert env["ROLE"]["value"] == "worker"
    assert env["KODA_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    config = k8s[("ConfigMap", "koda-config")]["data"]
    # Shared by every pod: an id there would be every worker's id.
    assert "KODA_WORKER_ID" not in config and "KODA_WORKER_ID" not in env
    # A Deployment's pod names change at every rollout: not a static instance id.
    assert config.get("KODA_STATIC_MEMBERSHIP", "false") == "false"
    secret = real_secret(secret_example)
    pod = Settings.from_env({**config, **secret, "KODA_POD_NAME": "koda-worker-7d9f-x2k4q"})
    assert (pod.worker_id, pod.worker_id_source) == ("koda-worker-7d9f-x2k4q", "pod")
    for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe_path(c, kind) in WORKER_ROUTES
    assert probe_path(c, "livenessProbe") == "/livez"
    assert probe_path(c, "readinessProbe") == "/readyz"
    config = k8s[("ConfigMap", "koda-config")]["data"]
    (port,) = c["ports"]
    assert port["containerPort"] == int(config["KODA_WORKER_PORT"])
    assert config["KODA_WORKER_HOST"] == "0.0.0.0"  # noqa: S104 - probes come from the node


def test_k8s_gateway_grace_probes_and_service(k8s) -> None:
    gateway = k8s[("Deployment", "koda-gateway")]
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        GATEWAY_SHUTDOWN_S
    )
    c = container(gateway)
    paths = gateway_paths()
    assert probe_path(c, "livenessProbe") == "/livez" and "/livez" in paths
    assert probe_path(c, "readinessProbe") == "/readyz" and "/readyz" in paths
    service = k8s[("Service", "koda-gateway")]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == c["ports"][0]["name"]
    assert c["ports"][0]["containerPort"] == int(
        k8s[("ConfigMap", "koda-config")]["data"]["KODA_GATEWAY_PORT"]
    )


def test_k8s_config_and_secrets_are_apart_and_prod_is_safe(k8s, secret_example) -> None:
    config = k8s[("ConfigMap", "koda-config")]["data"]
    assert set(config).isdisjoint(secret_example)
    assert {
        "KODA_DATABASE_URL",
        "KODA_API_TOKENS",
        "KODA_ADMIN_TOKEN",
        "KODA_OPENAI_API_KEY",
    } <= set(secret_example)
    assert not {k for k in config if "TOKEN" in k or "KEY" in k or "PASSWORD" in k}
    # The example's placeholders stop prod at start, naming the setting, not the value.
    with pytest.raises(ConfigError, match="refused in prod: KODA_API_TOKENS") as refused:
        Settings.from_env({**config, **secret_example})
    assert "REPLACE_ME_TOKEN" not in str(refused.value)
    # With real values the ConfigMap is a valid prod configuration (no demo handler).
    settings = Settings.from_env({**config, **real_secret(secret_example)})
    assert settings.app_env is AppEnv.PROD
    for (kind, _), doc in k8s.items():
        if kind in ("Deployment", "Job"):
            c = container(doc)
            refs = {next(iter(r.values()))["name"] for r in c["envFrom"]}
            assert refs == {"koda-config", "koda-secrets"}
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
    topics_job = container(k8s[("Job", "koda-topics")])
    assert topics_job["args"] == ["--confirm-prod"]


def test_k8s_gateway_prestop_lets_the_load_balancer_drain_within_the_grace(k8s) -> None:
    """The grace period counts from the start of the preStop: the sleep and the gateway's
    own shutdown must both fit in it."""
    gateway = k8s[("Deployment", "koda-gateway")]
    command = container(gateway)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    drain_s = float(command[1])
    assert drain_s >= 5
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain_s + GATEWAY_SHUTDOWN_S, (grace, drain_s, GATEWAY_SHUTDOWN_S)


def test_k8s_compactor_role_probes_and_port(k8s) -> None:
    compactor = k8s[("Deployment", "koda-compactor")]
    assert compactor["spec"]["replicas"] == 1
    c = container(compactor)
    assert {e["name"]: e.get("value") for e in c["env"]}["ROLE"] == "compactor"
    assert probe_path(c, "livenessProbe") == "/livez"
    assert probe_path(c, "readinessProbe") == "/readyz"
    assert {probe_path(c, k) for k in ("livenessProbe", "readinessProbe")} <= set(COMPACTOR_ROUTES)
    (port,) = c["ports"]
    assert port["containerPort"] == int(option(c["args"], "--port"))
    for kind in ("livenessProbe", "readinessProbe"):
        assert c[kind]["httpGet"]["port"] == port["name"]
    # The loop's own stall limit is what liveness acts on; the probe only asks it.
    from koda_runtime.processors.compactor import STALL_AFTER_S

    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < STALL_AFTER_S


def test_the_webhook_dispatcher_runs_as_its_own_role_with_probes(compose, k8s) -> None:
    from koda_runtime.processors.webhooks import STALL_AFTER_S

    service = compose["services"]["webhooks"]
    assert service["environment"]["ROLE"] == "webhooks"
    assert service["image"] == compose["services"]["migrate"]["image"]
    port = int(option(service["command"], "--port"))
    assert health_path(service["healthcheck"]["test"]) == "/livez"
    assert f"127.0.0.1:{port}/livez" in " ".join(service["healthcheck"]["test"])
    for dep in ("migrate", "topics"):
        assert service["depends_on"][dep]["condition"] == "service_completed_successfully"
    c = container(k8s[("Deployment", "koda-webhooks")])
    assert {e["name"]: e.get("value") for e in c["env"]}["ROLE"] == "webhooks"
    assert probe_path(c, "livenessProbe") == "/livez"
    assert probe_path(c, "readinessProbe") == "/readyz"
    (k8s_port,) = c["ports"]
    assert k8s_port["containerPort"] == int(option(c["args"], "--port")) == port
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < STALL_AFTER_S


def test_k8s_scheduler_probes_ask_its_health_endpoints(k8s) -> None:
    from koda_runtime.scheduler.bootstrap import STALL_AFTER_S

    scheduler = k8s[("Deployment", "koda-scheduler")]
    c = container(scheduler)
    assert probe_path(c, "livenessProbe") == "/livez"
    assert probe_path(c, "readinessProbe") == "/readyz"
    assert {"/livez", "/readyz"} <= set(SCHEDULER_ROUTES)
    (port,) = c["ports"]
    config = k8s[("ConfigMap", "koda-config")]["data"]
    assert port["containerPort"] == int(config["KODA_SCHEDULER_PORT"])
    for kind in ("livenessProbe", "readinessProbe"):
        assert c[kind]["httpGet"]["port"] == port["name"]
    # The loop's own stall limit is what liveness acts on; the probe only asks it.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < STALL_AFTER_S


def test_k8s_readme_says_how_prometheus_keeps_the_exemplars() -> None:
    readme = (K8S / "README.md").read_text()
    assert "--enable-feature=exemplar-storage" in readme and "OpenMetrics" in readme


def k8s_metrics_port(doc: dict[str, Any], config: dict[str, str]) -> int:
    """The port a Deployment's process serves /metrics on, as the process reads it."""
    c = container(doc)
    role = {e["name"]: e.get("value") for e in c["env"]}["ROLE"]
    if role in ("compactor", "webhooks"):
        return int(option(c["args"], "--port"))
    setting = {
        "gateway": "KODA_GATEWAY_PORT",
        "worker": "KODA_WORKER_PORT",
        "scheduler": "KODA_SCHEDULER_PORT",
    }[role]
    return int(config[setting])


def test_k8s_every_deployment_is_scraped_on_its_metrics_port(k8s) -> None:
    config = k8s[("ConfigMap", "koda-config")]["data"]
    deployments = {name: doc for (kind, name), doc in k8s.items() if kind == "Deployment"}
    assert set(deployments) == {
        "koda-gateway",
        "koda-worker",
        "koda-scheduler",
        "koda-compactor",
        "koda-webhooks",
    }
    for name, doc in deployments.items():
        annotations = doc["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        port = k8s_metrics_port(doc, config)
        assert int(annotations["prometheus.io/port"]) == port, name
        assert port in [p["containerPort"] for p in container(doc)["ports"]], name
        bind = config.get("KODA_WORKER_HOST")  # the scheduler's and compactor's too
        assert bind == "0.0.0.0", name  # noqa: S104 - scraped from other pods


def test_k8s_readme_states_the_broker_settings_koda_needs() -> None:
    """Every broker bound `koda topics check` reads, for both protocols, with the values
    the defaults of KODA_SESSION_TIMEOUT and KODA_KAFKA_HEARTBEAT need."""
    from koda_runtime.topics.admin import group_timings

    readme = (K8S / "README.md").read_text()
    for protocol in ("consumer", "classic"):
        for t in group_timings(Settings(app_env=AppEnv.DEV, group_protocol=protocol)):
            for bound in (t.low, t.high):
                assert f"`{bound}`" in readme, bound
    assert "45000" in readme and "`koda topics check`" in readme
    assert f"{int(DEFAULTS.session_timeout_s * 1000)}" in readme
    assert f"{int(DEFAULTS.heartbeat_interval_s * 1000)}" in readme


def test_k8s_disruption_budgets(k8s) -> None:
    pdb = k8s[("PodDisruptionBudget", "koda-worker")]["spec"]
    assert pdb["maxUnavailable"] == 1
    worker_labels = k8s[("Deployment", "koda-worker")]["spec"]["selector"]["matchLabels"]
    assert pdb["selector"]["matchLabels"] == worker_labels


def test_k8s_names_a_pgvector_postgres(k8s) -> None:
    annotations = k8s[("ConfigMap", "koda-config")]["metadata"]["annotations"]
    assert annotations["koda.dev/postgres-image"].startswith("pgvector/pgvector:pg18")


def test_k8s_connections_fit_postgres(k8s) -> None:
    config = k8s[("ConfigMap", "koda-config")]
    max_connections = int(config["metadata"]["annotations"]["koda.dev/postgres-max-connections"])
    assert "KODA_DB_POOL" not in config["data"]  # the default pool, as counted below
    worker_pool, gateway_pool = pool_sizes()
    workers = k8s[("Deployment", "koda-worker")]["spec"]
    gateways = k8s[("Deployment", "koda-gateway")]["spec"]
    # During a rolling update maxSurge pods exist beside the old ones.
    worker_pods = workers["replicas"] + workers["strategy"]["rollingUpdate"]["maxSurge"]
    gateway_pods = gateways["replicas"] + gateways["strategy"]["rollingUpdate"]["maxSurge"]
    schedulers = k8s[("Deployment", "koda-scheduler")]["spec"]
    assert container(k8s[("Deployment", "koda-scheduler")])["env"][0]["value"] == "scheduler"
    assert 1 <= schedulers["replicas"] <= 2
    scheduler_pods = schedulers["replicas"] + schedulers["strategy"]["rollingUpdate"]["maxSurge"]
    compactors = k8s[("Deployment", "koda-compactor")]["spec"]
    assert compactors["strategy"]["type"] == "Recreate"  # no second pod during a rollout
    hooks = k8s[("Deployment", "koda-webhooks")]["spec"]
    webhook_pods = hooks["replicas"] + hooks["strategy"]["rollingUpdate"]["maxSurge"]
    needed = (
        worker_pods * worker_pool
        + gateway_pods * gateway_pool
        + scheduler_pods * scheduler_pool()
        + compactors["replicas"] * compactor_pool()
        + webhook_pods * webhooks_pool()
        + MIGRATE_CONNECTIONS
    )
    assert needed <= max_connections - PG_RESERVED, (needed, max_connections)


def test_the_operations_doc_states_the_connection_budget() -> None:
    readme = (ROOT / "docs" / "operations.md").read_text()
    assert "max_connections" in readme and "each worker holds up to `KODA_DB_POOL`" in readme


def test_the_image_copies_every_package_pyproject_installs() -> None:
    """A package left out of the Dockerfile installs nothing and its role dies at import."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = re.findall(r"^COPY ([\w/]+) \./\1$", (DEPLOY / "Dockerfile").read_text(), re.M)
    for folder in folders:
        assert folder in copied or any(c.startswith(folder + "/") for c in copied), folder
    for c in copied:
        assert c.split("/")[0] in folders, c
