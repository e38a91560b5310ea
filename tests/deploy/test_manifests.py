"""The compose file and the Kubernetes manifests validate offline, and say what we mean.

No Docker engine or cluster here: the compose file is checked with ``compose-spec`` (a
strict Rust parser of the Compose specification) after the two steps Compose itself takes
first, YAML merge keys and ``${VAR:-default}`` interpolation; the manifests with
``kubernetes-validate`` in strict mode (unknown fields are errors) against bundled schemas.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate_defaults(text: str) -> str:
    """Compose's ``${VAR:-default}`` with an empty environment: every default applies."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", text)


def compose_data() -> dict[str, Any]:
    data = yaml.safe_load(interpolate_defaults(COMPOSE.read_text()))  # resolves `<<:` merges
    assert isinstance(data, dict)
    return data


def validate_compose(data: dict[str, Any]) -> PyCompose:
    return PyCompose.from_json(json.dumps(data))


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in k8s_documents() if doc["kind"] == kind]


# --------------------------------------------------------------------------- compose


def test_compose_file_validates() -> None:
    compose = validate_compose(compose_data())
    assert set(compose.service_names()) == {"redis", "replica-0", "replica-1", "gateway"}


def test_compose_validator_rejects_mistakes() -> None:
    """The validator is strict enough to catch typos, so its pass above means something."""
    for service, mistake in [
        ("redis", {"restart": "sometimes"}),
        ("gateway", {"port": ["8000:8000"]}),
        ("replica-0", {"healthcheck": {"test": ["CMD", "true"], "interval": "5q"}}),
    ]:
        data = compose_data()
        data["services"][service].update(mistake)
        with pytest.raises(ValueError):
            validate_compose(data)


def test_compose_gives_each_replica_its_own_gpu_and_a_shared_model_volume() -> None:
    services = compose_data()["services"]
    replicas = [name for name in services if name.startswith("replica-")]
    gpus = []
    for name in replicas:
        service = services[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert "models:/cache" in service["volumes"]
        env = service["environment"]
        # No explicit id: the replica is then named host:port, as the gateway names it.
        assert "PREFIXGATE_REPLICA_ID" not in env
        assert env["PREFIXGATE_ADVERTISE_URL"] == f"http://{name}:{env['PREFIXGATE_PORT']}"
        assert service["restart"] == "unless-stopped"
        assert "/health" in " ".join(service["healthcheck"]["test"])
    assert sorted(gpus) == [str(i) for i in range(len(replicas))]


def test_compose_gateway_is_published_and_knows_every_replica() -> None:
    services = compose_data()["services"]
    gateway = services["gateway"]
    assert gateway["ports"] == ["8000:8000"]
    assert "/ready" in " ".join(gateway["healthcheck"]["test"])
    replica_urls = {
        s["environment"]["PREFIXGATE_ADVERTISE_URL"]
        for name, s in services.items()
        if name.startswith("replica-")
    }
    assert set(gateway["environment"]["PREFIXGATE_REPLICA"].split(",")) == replica_urls
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


# --------------------------------------------------------------------------- kubernetes


def test_every_manifest_validates_strictly() -> None:
    docs = k8s_documents()
    assert docs
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)} {doc['kind']}: {exc}")


def test_strict_validation_rejects_a_typo() -> None:
    (statefulset,) = by_kind("StatefulSet")
    statefulset["spec"]["replica"] = statefulset["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSION, strict=True)


def test_replicas_get_one_gpu_each_and_ready_on_health() -> None:
    (statefulset,) = by_kind("StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    headless = [
        s for s in by_kind("Service") if s["metadata"]["name"] == statefulset["spec"]["serviceName"]
    ]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"


def test_gateway_scales_out_behind_a_service() -> None:
    deployments = {d["metadata"]["name"]: d for d in by_kind("Deployment")}
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] in deployments
    gateway = deployments[target["name"]]
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["requests"]["cpu"]  # utilization targets need a request
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert any(s["spec"].get("selector", {}).items() <= labels.items() for s in by_kind("Service"))
    # Scale-in and rolling updates: it keeps accepting until the Service stops sending
    # clients to it, then finishes its streams within the grace period.
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep" and int(pause[1]) > 0
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(pause[1])
    # Its start may wait for a Hub model's tokenizer (up to 30 s): the liveness probe, with
    # no startup probe before it, killed it first (3 failures 10 s apart).
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


def test_workloads_read_settings_from_the_configmap_that_exists() -> None:
    configmaps = {c["metadata"]["name"]: c["data"] for c in by_kind("ConfigMap")}
    workloads = by_kind("Deployment") + by_kind("StatefulSet")
    prefixgate = [
        w for w in workloads if w["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
    ]
    for workload in prefixgate:
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        for source in container["envFrom"]:
            data = configmaps[source["configMapRef"]["name"]]
            assert all(key.startswith("PREFIXGATE_") for key in data)


# --------------------------------------------------------------------------- image


def test_dockerfile_copies_every_package_and_runs_unprivileged() -> None:
    """No engine here to build it; check what a build would silently get wrong."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    copied = re.findall(r"^COPY (\S+) ", dockerfile, flags=re.MULTILINE)
    assert set(packages) <= set(copied), f"Dockerfile misses {set(packages) - set(copied)}"
    assert re.search(r"^FROM pytorch/pytorch:\S+-cuda\S+-runtime$", dockerfile, re.MULTILINE)
    assert re.search(r"^USER (?!root)\w+$", dockerfile, re.MULTILINE)
    assert 'ENTRYPOINT ["prefixgate"]' in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(packages) & set(ignored)


# --------------------------------------------------------------------------- vLLM variants

COMPOSE_VLLM = ROOT / "deploy" / "compose.vllm.yaml"
K8S_VLLM = ROOT / "deploy" / "k8s-vllm"


def test_vllm_compose_validates_and_pairs_each_engine_with_a_bridge() -> None:
    data = yaml.safe_load(interpolate_defaults(COMPOSE_VLLM.read_text()))
    services = validate_compose(data).service_names()
    engines = sorted(s for s in services if s.startswith("engine-"))
    assert engines == ["engine-0", "engine-1"]
    config = data["services"]
    gateway_urls = set(config["gateway"]["environment"]["PREFIXGATE_REPLICA"].split(","))
    for engine in engines:
        command = " ".join(config[engine]["command"])
        assert "--enable-prefix-caching" in command and '"endpoint": "tcp://*:5557"' in command
        bridge = config[engine.replace("engine", "bridge")]
        env = bridge["environment"]
        assert bridge["command"] == ["bridge"]
        assert env["PREFIXGATE_KV_EVENTS"] == f"tcp://{engine}:5557"
        assert env["PREFIXGATE_REPLAY"] == f"tcp://{engine}:5558"
        assert env["PREFIXGATE_ENGINE_URL"] in gateway_urls  # the bridge registers that URL
        assert env["PREFIXGATE_MODEL"] == config["gateway"]["environment"]["PREFIXGATE_MODEL"]


def test_vllm_manifests_validate_and_run_a_bridge_beside_each_engine() -> None:
    docs = [
        (path, doc)
        for path in sorted(K8S_VLLM.rglob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)} {doc['kind']}: {exc}")
    (statefulset,) = [doc for _, doc in docs if doc["kind"] == "StatefulSet"]
    containers = {c["name"]: c for c in statefulset["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"vllm", "bridge"}
    assert containers["vllm"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert '"endpoint": "tcp://*:5557"' in " ".join(containers["vllm"]["args"])
    env = {e["name"]: e.get("value") for e in containers["bridge"]["env"]}
    assert env["PREFIXGATE_KV_EVENTS"] == "tcp://127.0.0.1:5557"
    service = statefulset["spec"]["serviceName"]
    assert f".{service}." in env["PREFIXGATE_ADVERTISE_URL"]
    configmaps = {c["metadata"]["name"] for c in by_kind("ConfigMap")}
    assert containers["bridge"]["envFrom"][0]["configMapRef"]["name"] in configmaps


def test_the_example_keys_secret_parses_as_the_gateway_reads_it() -> None:
    """Its keys, and its commented trial key once uncommented (the fields an operator
    copies from it)."""
    from gateway.auth import parse_api_keys

    (secret,) = by_kind("Secret")
    text = secret["stringData"]["api-keys.yaml"]
    assert {t.name for t in parse_api_keys(yaml.safe_load(text)).values()} == {"team-a", "team-b"}
    trial = parse_api_keys(yaml.safe_load(text.replace("# sk-", "sk-")))
    (tenant,) = [t for t in trial.values() if t.name == "trial"]
    assert (tenant.rpm_limit, tenant.tpm_limit, tenant.max_parallel_requests) == (60, 20000, 4)
    assert tenant.models == frozenset({"smollm2-135m"})
