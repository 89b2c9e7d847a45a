"""k8s/: each overlay rendered (``kubectl kustomize``, exactly as ``kubectl
apply -k`` would), validated strictly (an unknown field fails), checked, and
compared with compose; docs/kubernetes.md ("Checked here, and not") says what.
Each checker yields its violations (tests/manifests.py says why).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from pdstack import config, route
from pdstack.compose import PORTS_ENV, ROOT
from tests import manifests
from tests.manifests import HEALTH, environment, ports, served

K8S = ROOT / "k8s"
BASE = K8S / "base"
OVERLAY_DIR = K8S / "overlays"

# The oldest Kubernetes minor still widely run (managed offerings' extended
# support) and the newest the pinned kubernetes-validate has schemas for.
K8S_VERSIONS = ("1.30.0", "1.37.0")

Object = dict[str, Any]
Serves = Callable[[list[str], Mapping[str, str]], str]  # the serves fixture
# What an overlay renders to (and the schema check covers).
KINDS = {"ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy"}


# Workload and container names in the manifests. Workloads are named after
# the roles, so Service DNS names read prefill-0.prefill, decode-0.decode.
SERVING = config.ROLES
ROUTER = "router"
ROUTER_URLS = ("PREFILL_URL", "DECODE_URL")  # its backends, in its environment

RDMA_COMPONENT = "../../components/rdma"


def compose_twin(overlay: str) -> tuple[tuple[str, ...], tuple[str, str, str]]:
    """An overlay's compose twin: the compose profiles to enable and the trio
    (prefill, decode, router); the rdma trio where it uses components/rdma."""
    kustomization = yaml.safe_load(
        (OVERLAY_DIR / overlay / "kustomization.yaml").read_text()
    )
    if RDMA_COMPONENT in (kustomization.get("components") or []):
        return ("rdma",), manifests.RDMA_TRIO
    return (), manifests.TCP_TRIO


# One overlay per profile of configs/profiles/, named after it (PD_PROFILE):
# a new profile gets one from `python -m pdstack.profile` (docs/models.md).
OVERLAYS = {
    name: compose_twin(name)
    for name in config.profile_names()
    if (OVERLAY_DIR / name / "kustomization.yaml").is_file()
}
each_overlay = pytest.mark.parametrize("overlay", sorted(OVERLAYS))
# Each workload's named ports and the configs/ports.env variable each carries
# (on the container and on the workload's Service).
NAMED_PORTS = {
    ("prefill", "http"): "PREFILL_PORT",
    ("prefill", "bootstrap"): "BOOTSTRAP_PORT",
    ("decode", "http"): "DECODE_PORT",
    (ROUTER, "http"): "ROUTER_PORT",
    (ROUTER, "metrics"): "ROUTER_METRICS_PORT",
}


# --- rendering -----------------------------------------------------------------


@functools.cache
def _rendered_text(path: Path) -> str:
    result = manifests.run(manifests.tool("kubectl"), "kustomize", path)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(overlay: str | Path) -> list[Object]:
    """The objects `kubectl apply -k` would send; fresh, so tests may mutate."""
    path = overlay if isinstance(overlay, Path) else OVERLAY_DIR / overlay
    return [o for o in yaml.safe_load_all(_rendered_text(path)) if o]


def configmap(objects: list[Object], key: str) -> Object:
    """The one ConfigMap holding ``key`` (the generated names carry a hash)."""
    (found,) = (
        o for o in objects if o["kind"] == "ConfigMap" and key in (o.get("data") or {})
    )
    return found


def find(objects: list[Object], kind: str, name: str) -> Object:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects: list[Object]) -> dict[str, Object]:
    kinds = ("StatefulSet", "Deployment")
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in kinds}


def servers(objects: list[Object]) -> list[tuple[str, Object]]:
    return [(name, workloads(objects)[name]) for name in SERVING]


def pod(workload: Object) -> Object:
    return cast(Object, workload["spec"]["template"]["spec"])


def main_container(workload: Object) -> Object:
    (container,) = pod(workload)["containers"]
    return container


def all_containers(workload: Object) -> list[Object]:
    return [*pod(workload).get("initContainers", []), *pod(workload)["containers"]]


def named(items: list[Object], name: str) -> Object:
    """The one item called ``name`` (a volume, an env entry)."""
    (item,) = (i for i in items if i["name"] == name)
    return item


def named_port(container: Object, name: str) -> int | None:
    ports = container.get("ports", [])
    return next((int(p["containerPort"]) for p in ports if p.get("name") == name), None)


def container_env(objects: list[Object], container: Object) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first,
    then env (which wins), with $(VAR) references expanded. The downward API's
    values, known only at run time, become markers."""
    reference = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, f"unsupported envFrom {source}: extend container_env"
        data = find(objects, "ConfigMap", ref["name"]).get("data") or {}
        env.update({source.get("prefix", "") + k: str(v) for k, v in data.items()})
    for item in container.get("env", []):
        match item:
            case {"name": name, "value": value}:
                env[name] = reference.sub(lambda m: env.get(m[1], m[0]), str(value))
            case {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}:
                env[name] = f"<field {path}>"
            case _:
                pytest.fail(f"unsupported env source {item}: extend container_env")
    return env


# --- compose, for comparison ------------------------------------------------------


def compose_services(overlay: str) -> dict[str, Object]:
    """Compose's service for each workload (prefill, decode, router)."""
    compose_profiles, trio = OVERLAYS[overlay]
    # .env and configs/ports.env as on a GPU host; PD_PROFILE from the "shell".
    model = manifests.compose_config(compose_profiles, env={"PD_PROFILE": overlay})
    names = zip((*SERVING, ROUTER), trio, strict=True)
    return {name: model["services"][service] for name, service in names}


def duration_s(text: str) -> float:
    """A compose duration as `docker compose config` prints it (1h2m3s, 30s)."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(n) * units[u] for n, u in parts)


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (binary or decimal suffix) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, text
    power = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    power |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    return int(match[1]) * power.get(match[2] or "", 1)


# --- invariant checkers: each yields its violations --------------------------------


def probe_violations(objects: list[Object]) -> Iterator[str]:
    """Probes GET /health on the http port; servers also have a startupProbe."""
    for name, workload in workloads(objects).items():
        container = main_container(workload)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if (probe := container.get(kind)) is None:
                if kind != "startupProbe" or name in SERVING:
                    yield f"{name}: no {kind}"
                continue
            get = probe.get("httpGet") or {}
            on_http = get.get("port") in ("http", named_port(container, "http"))
            if get.get("path") != HEALTH or not on_http:
                yield f"{name}: {kind} must GET {HEALTH} on port http"


def security_violations(objects: list[Object]) -> Iterator[str]:
    """Non-root, nothing privileged, only the capabilities the role needs."""
    for name, workload in workloads(objects).items():
        spec = pod(workload)
        context = spec.get("securityContext") or {}
        if context.get("runAsNonRoot") is not True or not context.get("runAsUser"):
            yield f"{name}: pod must set runAsNonRoot and a non-0 runAsUser"
        # Host namespaces: NetworkPolicies stop applying, ports open on the node.
        for field in filter(spec.get, ("hostNetwork", "hostPID", "hostIPC")):
            yield f"{name}: {field} shares the node's namespace"
        # A Service named router would inject ROUTER_PORT=tcp://... otherwise.
        if spec.get("enableServiceLinks") is not False:
            yield f"{name}: enableServiceLinks must be false"
        for container in all_containers(workload):
            where = f"{name}/{container['name']}"
            own = container.get("securityContext") or {}
            if own.get("privileged"):
                yield f"{where}: privileged"
            if own.get("allowPrivilegeEscalation") is not False:
                yield f"{where}: allowPrivilegeEscalation must be false"
            if own.get("runAsUser") == 0 or own.get("runAsNonRoot") is False:
                yield f"{where}: runs as root"
            caps = own.get("capabilities") or {}
            if "ALL" not in caps.get("drop", []):
                yield f"{where}: must drop ALL capabilities"
            # Only the servers' main containers add one capability, and need it.
            main = container["name"] == main_container(workload)["name"]
            allowed = {"IPC_LOCK"} if main and name in SERVING else set()
            added = set(caps.get("add", []))
            if added - allowed:
                yield f"{where}: adds {sorted(added - allowed)}"
            if allowed - added:
                yield f"{name}: needs IPC_LOCK (RDMA pins memory)"


def shm_violations(objects: list[Object]) -> Iterator[str]:
    """Servers get a memory-backed, bounded /dev/shm (compose's shm_size)."""
    for name, workload in servers(objects):
        mounts = main_container(workload).get("volumeMounts", [])
        shm = next((m["name"] for m in mounts if m["mountPath"] == "/dev/shm"), "")
        volumes = {v["name"]: v for v in pod(workload).get("volumes", [])}
        empty_dir = volumes.get(shm, {}).get("emptyDir")
        if not empty_dir or empty_dir.get("medium") != "Memory":
            yield f"{name}: /dev/shm must be an emptyDir, medium Memory"
        elif not empty_dir.get("sizeLimit"):
            yield f"{name}: /dev/shm needs a sizeLimit"


def _secret_files(workload: Object, container: Object) -> set[str]:
    """Paths of the files this container gets from Secrets (and nothing else)."""
    volumes = {v["name"]: v for v in pod(workload).get("volumes", [])}
    files: set[str] = set()
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        projected = (volume.get("projected") or {}).get("sources", [])
        sources = [{"secret": volume["secret"]}] if "secret" in volume else projected
        if all(set(s) == {"secret"} for s in sources):  # purely secret-backed
            # Without items, every key: file names unknown until run time.
            items = [i for s in sources for i in s["secret"].get("items") or []]
            files.update(f"{mount['mountPath']}/{i['path']}" for i in items)
    return files


def secret_violations(objects: list[Object]) -> Iterator[str]:
    """Secrets only as Secret-backed files (or secretKeyRef), never plain values."""
    for o in (o for o in objects if o["kind"] == "ConfigMap"):
        for key in filter(manifests.SECRET_NAME.search, o.get("data") or {}):
            yield f"ConfigMap {o['metadata']['name']}: secret {key} in a ConfigMap"
    for name, workload in workloads(objects).items():
        for container in all_containers(workload):
            env = container.get("env", [])
            plain = {e["name"]: str(e["value"]) for e in env if "value" in e}
            where = f"{name}/{container['name']}"
            files = _secret_files(workload, container)
            yield from manifests.secret_env_violations(where, plain, files)


def image_violations(objects: list[Object], overlay: str) -> Iterator[str]:
    """Every container runs compose's image for the same service."""
    expected = {name: s["image"] for name, s in compose_services(overlay).items()}
    for name, workload in workloads(objects).items():
        for container in all_containers(workload):
            if container["image"] != expected.get(name):
                where, image = f"{name}/{container['name']}", container["image"]
                yield f"{where}: image {image}, compose runs {expected.get(name)}"


def selects(selector: Object, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions with In) on ``labels``;
    the checkers refuse what this cannot evaluate."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", f"extend selects for {expression}"
        ok = ok and labels.get(expression["key"]) in expression["values"]
    return ok


def network_violations(objects: list[Object]) -> Iterator[str]:
    """Prefill and decode take ingress only from the stack's own pods."""
    pods = {name: pod_labels(w) for name, w in workloads(objects).items()}
    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"]
    for name in SERVING:
        selecting = [p for p in policies if selects(p["podSelector"], pods[name])]
        if not any("Ingress" in p.get("policyTypes", []) for p in selecting):
            yield f"{name}: no NetworkPolicy restricts its ingress"
        for policy in selecting:
            for rule in policy.get("ingress", []):
                peers = rule.get("from") or []
                if not peers:
                    yield f"{name}: an ingress rule admits every source"
                for peer in peers:
                    if set(peer) != {"podSelector"}:
                        yield f"{name}: ingress from outside the stack"
                    elif not any(
                        selects(peer["podSelector"], labels) for labels in pods.values()
                    ):
                        yield f"{name}: ingress from pods not in the stack"


def pod_labels(workload: Object) -> dict[str, str]:
    return cast(dict[str, str], workload["spec"]["template"]["metadata"]["labels"])


def service_violations(objects: list[Object]) -> Iterator[str]:
    """Prefill/decode: StatefulSets behind headless Services; the router's
    backends are their pods by stable name, on their http ports."""
    found = workloads(objects)
    router_env = container_env(objects, main_container(found[ROUTER]))
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for name, workload in servers(objects):
        if workload["kind"] != "StatefulSet":
            yield f"{name}: must be a StatefulSet (stable pod names)"
            continue
        service_name = workload["spec"].get("serviceName", "")
        spec = services.get(service_name, {}).get("spec")
        if not spec or spec.get("clusterIP") != "None":
            yield f"{name}: serviceName must be a headless Service"
        elif not selects({"matchLabels": spec["selector"]}, pod_labels(workload)):
            yield f"{name}: its Service does not select its pods"
        # Names must not vanish from DNS on a readiness blip (prefill.yaml).
        elif spec.get("publishNotReadyAddresses") is not True:
            yield f"{name}: its Service must publishNotReadyAddresses"
        url = urlsplit(router_env.get(f"{name.upper()}_URL", ""))
        expected_host = f"{workload['metadata']['name']}-0.{service_name}"
        if url.hostname != expected_host:
            yield f"router: {name.upper()}_URL must name {expected_host}"
        if url.port != named_port(main_container(workload), "http"):
            yield f"router: {name.upper()}_URL is not on {name}'s http port"
    # The init container must wait for the backends the router will use.
    for init in pod(found[ROUTER]).get("initContainers", []):
        env = container_env(objects, init)
        for variable in ROUTER_URLS:
            if env.get(variable) != router_env.get(variable):
                yield f"router/{init['name']}: waits on another {variable}"


def port_violations(objects: list[Object]) -> Iterator[str]:
    """Every port number is the one configs/ports.env sets: on the containers,
    their Services and in their environment."""
    found, port_env = workloads(objects), ports()
    for (name, port), variable in NAMED_PORTS.items():
        expected = int(port_env[variable])
        if named_port(main_container(found[name]), port) != expected:
            yield f"{name}: {port} port is not {variable}={expected}"
        service = find(objects, "Service", name)["spec"]["ports"]
        if {p["name"]: p["port"] for p in service}.get(port) != expected:
            yield f"Service {name}: {port} port is not {expected}"
    annotations = found["prefill"]["spec"]["template"]["metadata"].get("annotations")
    if (annotations or {}).get("vllm.ai/bootstrap-port") != port_env["BOOTSTRAP_PORT"]:
        yield "prefill: annotation vllm.ai/bootstrap-port is wrong"
    for name in (*SERVING, ROUTER):
        env = container_env(objects, main_container(found[name]))
        if drift := sorted(k for k, v in port_env.items() if env.get(k) != v):
            yield f"{name}: environment disagrees on {drift}"


def _gpus_per_role(profile_name: str) -> int:
    chosen = config.profile(profile_name)
    tensor_parallel = chosen.get("vllm", {}).get("tensor-parallel-size")
    return int(chosen.get("gpus_per_role") or tensor_parallel or 1)


def gpu_violations(objects: list[Object], profile_name: str) -> Iterator[str]:
    """Each server requests the GPUs its profile needs; the router none."""
    expected = _gpus_per_role(profile_name)
    for name, workload in workloads(objects).items():
        limits = main_container(workload).get("resources", {}).get("limits", {})
        gpus = int(limits.get("nvidia.com/gpu", 0))
        want = expected if name in SERVING else 0
        if gpus != want:
            yield f"{name}: {gpus} GPUs, profile {profile_name} needs {want}"


def reference_violations(objects: list[Object]) -> Iterator[str]:
    """ConfigMaps that pods read must be part of the rendering."""
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    for name, workload in workloads(objects).items():
        for container in all_containers(workload):
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef", {}).get("name")
                if ref and ref not in names:
                    yield f"{name}/{container['name']}: no ConfigMap {ref}"


def placement_violations(objects: list[Object]) -> Iterator[str]:
    """kimi-k2.5: each server alone on its node (no two prefill/decode pods)."""
    for name, workload in servers(objects):
        anti = (pod(workload).get("affinity") or {}).get("podAntiAffinity", {})
        apart = {
            other
            for term in anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
            if term.get("topologyKey") == "kubernetes.io/hostname"
            for other, peer in servers(objects)
            if selects(term["labelSelector"], pod_labels(peer))
        }
        if missing := sorted(set(SERVING) - apart):
            yield f"{name}: not kept off nodes with {missing}"


# --- the overlays: schema and invariants --------------------------------------------


def test_every_overlay_has_a_profile_a_compose_twin_and_docs() -> None:
    assert {p.name for p in OVERLAY_DIR.iterdir() if p.is_dir()} == set(OVERLAYS)
    missing = sorted(set(config.profile_names()) - set(OVERLAYS))
    assert not missing, (
        f"profiles without an overlay: {missing}; write one with "
        "`python -m pdstack.profile overlay NAME` (docs/models.md)"
    )
    # The deploy command: docs/kubernetes.md says it for every profile, each
    # overlay's header for its own.
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "apply -k k8s/overlays/<profile>" in docs
    for overlay in OVERLAYS:
        header = (OVERLAY_DIR / overlay / "kustomization.yaml").read_text()
        assert f"kubectl apply -k k8s/overlays/{overlay}" in header, overlay


@pytest.mark.parametrize("version", K8S_VERSIONS)
@each_overlay
def test_rendered_objects_pass_strict_schema_validation(
    overlay: str, version: str
) -> None:
    objects = render(overlay)
    assert {o["kind"] for o in objects} == KINDS
    for o in objects:
        kubernetes_validate.validate(o, version, strict=True)


def test_strict_validation_rejects_an_unknown_field_and_a_wrong_type() -> None:
    prefill, router = (workloads(render("tiny"))[name] for name in ("prefill", ROUTER))
    container = main_container(prefill)
    container["imagePulPolicy"] = container.pop("imagePullPolicy")
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePulPolicy"):
        kubernetes_validate.validate(prefill, K8S_VERSIONS[0], True)
    router["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError, match="'one'"):
        kubernetes_validate.validate(router, K8S_VERSIONS[-1], True)


@each_overlay
def test_invariants_hold(overlay: str) -> None:
    objects = render(overlay)
    assert [
        *probe_violations(objects),
        *security_violations(objects),
        *shm_violations(objects),
        *secret_violations(objects),
        *image_violations(objects, overlay),
        *network_violations(objects),
        *service_violations(objects),
        *port_violations(objects),
        *gpu_violations(objects, overlay),
        *reference_violations(objects),
        *(placement_violations(objects) if _gpus_per_role(overlay) > 1 else ()),
    ] == []


# Negative controls on the tiny overlay: each breaks a fresh render (its
# objects and their workloads) and returns what its checker must report, sorted.


def _break_probes(objects: list[Object], found: dict[str, Object]) -> list[str]:
    main_container(found["prefill"])["readinessProbe"]["httpGet"]["path"] = "/"
    del main_container(found["decode"])["startupProbe"]
    main_container(found[ROUTER])["livenessProbe"] = {"tcpSocket": {"port": "http"}}
    return [
        "decode: no startupProbe",
        "prefill: readinessProbe must GET /health on port http",
        "router: livenessProbe must GET /health on port http",
    ]


def _break_security(objects: list[Object], found: dict[str, Object]) -> list[str]:
    prefill = main_container(found["prefill"])
    prefill["securityContext"]["privileged"] = True
    prefill["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
    del pod(found["decode"])["securityContext"]["runAsNonRoot"]
    del main_container(found["decode"])["securityContext"]["capabilities"]["add"]
    init = pod(found[ROUTER])["initContainers"][0]
    init["securityContext"]["allowPrivilegeEscalation"] = True
    pod(found[ROUTER])["enableServiceLinks"] = True
    pod(found[ROUTER])["hostNetwork"] = True
    return [
        "decode: needs IPC_LOCK (RDMA pins memory)",
        "decode: pod must set runAsNonRoot and a non-0 runAsUser",
        "prefill/vllm: adds ['SYS_ADMIN']",
        "prefill/vllm: privileged",
        "router/wait-for-backends: allowPrivilegeEscalation must be false",
        "router: enableServiceLinks must be false",
        "router: hostNetwork shares the node's namespace",
    ]


def _break_secrets(objects: list[Object], found: dict[str, Object]) -> list[str]:
    hf_token = {"name": "HF_TOKEN", "value": "hf_abc"}
    main_container(found["prefill"])["env"].append(hf_token)
    router_env = main_container(found[ROUTER])["env"]
    named(router_env, "ROUTER_API_KEY_FILE")["value"] = "/tmp/api_key"
    pd_ports = configmap(objects, "ROUTER_PORT")
    pd_ports["data"]["API_KEY"] = "k"
    # A file path into a volume that is not (only) a Secret does not count.
    secrets = named(pod(found["decode"])["volumes"], "secrets")["projected"]
    secrets["sources"].append({"configMap": {"name": "x"}})
    return [
        f"ConfigMap {pd_ports['metadata']['name']}: secret API_KEY in a ConfigMap",
        "decode/vllm: HF_TOKEN_PATH is not a file from a secret",
        "prefill/vllm: secret HF_TOKEN as a plain value",
        "router/router: ROUTER_API_KEY_FILE is not a file from a secret",
    ]


@pytest.mark.parametrize(
    ("checker", "breaks"),
    [
        pytest.param(probe_violations, _break_probes, id="probe"),
        pytest.param(security_violations, _break_security, id="security"),
        pytest.param(secret_violations, _break_secrets, id="secret"),
    ],
)
def test_checker_catches_violations(
    checker: Callable[[list[Object]], Iterator[str]],
    breaks: Callable[[list[Object], dict[str, Object]], list[str]],
) -> None:
    objects = render("tiny")
    expected = breaks(objects, workloads(objects))
    assert sorted(checker(objects)) == expected


def test_shm_checker_catches_violations() -> None:
    objects = render("tiny")
    found = workloads(objects)
    named(pod(found["prefill"])["volumes"], "dshm")["emptyDir"] = {}
    del named(pod(found["decode"])["volumes"], "dshm")["emptyDir"]["sizeLimit"]
    assert list(shm_violations(objects)) == [
        "prefill: /dev/shm must be an emptyDir, medium Memory",
        "decode: /dev/shm needs a sizeLimit",
    ]


def test_image_checker_catches_violations() -> None:
    objects = render("tiny")
    found = workloads(objects)
    main_container(found["decode"])["image"] = "vllm/vllm-openai:latest"
    pod(found[ROUTER])["initContainers"][0]["image"] = "curlimages/curl:8.0.0"
    assert list(image_violations(objects, "tiny")) == [
        "router/wait-for-backends: image curlimages/curl:8.0.0, "
        "compose runs pd-mooncake/router:local",
        "decode/vllm: image vllm/vllm-openai:latest, "
        "compose runs pd-mooncake/serving:local",
    ]


def test_network_checker_catches_violations() -> None:
    objects = render("tiny")
    ingress = find(objects, "NetworkPolicy", "prefill")["spec"]["ingress"]
    ingress.append({"ports": [{"port": "bootstrap"}]})
    ingress.append({"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]})
    ingress.append({"from": [{"podSelector": {"matchLabels": {"app": "other"}}}]})
    objects.remove(find(objects, "NetworkPolicy", "decode"))
    assert list(network_violations(objects)) == [
        "prefill: an ingress rule admits every source",
        "prefill: ingress from outside the stack",
        "prefill: ingress from pods not in the stack",
        "decode: no NetworkPolicy restricts its ingress",
    ]


def test_service_checker_catches_violations() -> None:
    objects = render("tiny")
    find(objects, "Service", "prefill")["spec"]["clusterIP"] = "10.0.0.7"
    find(objects, "Service", "decode")["spec"]["publishNotReadyAddresses"] = False
    router_env = main_container(workloads(objects)[ROUTER])["env"]
    named(router_env, "PREFILL_URL")["value"] = "http://prefill:8100"
    assert list(service_violations(objects)) == [
        "prefill: serviceName must be a headless Service",
        "router: PREFILL_URL must name prefill-0.prefill",
        "decode: its Service must publishNotReadyAddresses",
        "router/wait-for-backends: waits on another PREFILL_URL",
    ]
    workloads(objects)["decode"]["kind"] = "Deployment"
    problems = service_violations(objects)
    assert "decode: must be a StatefulSet (stable pod names)" in problems


def test_port_checker_catches_violations() -> None:
    objects = render("tiny")
    configmap(objects, "ROUTER_PORT")["data"]["DECODE_PORT"] = "1"
    main_container(workloads(objects)["prefill"])["ports"][1]["containerPort"] = 9
    main_container(workloads(objects)[ROUTER])["ports"][1]["containerPort"] = 9
    find(objects, "Service", ROUTER)["spec"]["ports"][0]["port"] = 80
    assert list(port_violations(objects)) == [
        "prefill: bootstrap port is not BOOTSTRAP_PORT=8998",
        "Service router: http port is not 8000",
        "router: metrics port is not ROUTER_METRICS_PORT=29000",
        "prefill: environment disagrees on ['DECODE_PORT']",
        "decode: environment disagrees on ['DECODE_PORT']",
        "router: environment disagrees on ['DECODE_PORT']",
    ]


def test_gpu_checker_catches_violations() -> None:
    objects = render("kimi-k2.5")
    for name, gpus in (("decode", 4), (ROUTER, 1)):
        limits = main_container(workloads(objects)[name])["resources"]["limits"]
        limits["nvidia.com/gpu"] = gpus
    assert sorted(gpu_violations(objects, "kimi-k2.5")) == [
        "decode: 4 GPUs, profile kimi-k2.5 needs 8",
        "router: 1 GPUs, profile kimi-k2.5 needs 0",
    ]


def test_reference_checker_catches_the_base_alone() -> None:
    # The base names pd-serving but only overlays generate it (PD_PROFILE
    # comes from the overlay, as compose requires it from .env).
    assert list(reference_violations(render(BASE))) == [
        "decode/vllm: no ConfigMap pd-serving",
        "prefill/vllm: no ConfigMap pd-serving",
    ]
    assert "PD_PROFILE" not in _rendered_text(BASE)


def test_placement_checker_catches_violations() -> None:
    objects = render("kimi-k2.5")
    assert list(placement_violations(objects)) == []
    affinity = pod(workloads(objects)["prefill"])["affinity"]["podAntiAffinity"]
    term = affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
    term["labelSelector"]["matchExpressions"][1]["values"] = ["prefill"]
    del pod(workloads(objects)["decode"])["affinity"]
    assert list(placement_violations(objects)) == [
        "prefill: not kept off nodes with ['decode']",
        "decode: not kept off nodes with ['decode', 'prefill']",
    ]


# --- ports: configs/ports.env, through the checked copy -------------------------------


def test_base_ports_env_is_configs_ports_env() -> None:
    copy_text, source = (BASE / "ports.env").read_text(), PORTS_ENV.read_text()
    header = copy_text[: len(copy_text) - len(source)]
    assert copy_text.endswith(source), (
        "k8s/base/ports.env drifted from configs/ports.env; regenerate it with "
        "the command in its header"
    )
    assert all(line.startswith("#") for line in header.splitlines()), header


def test_kustomize_refuses_a_file_outside_its_root(tmp_path: Path) -> None:
    # Why k8s/base keeps a copy: a generator reading ../configs/ports.env fails.
    (tmp_path / "ports.env").write_text(PORTS_ENV.read_text())
    root = tmp_path / "k"
    root.mkdir()
    (root / "kustomization.yaml").write_text(
        "configMapGenerator:\n  - name: p\n    envs: [../ports.env]\n"
    )
    result = manifests.run(manifests.tool("kubectl"), "kustomize", root)
    assert result.returncode != 0
    assert "is not in or below" in result.stderr


def test_manifests_hold_no_port_numbers() -> None:
    assert manifests.port_numbers_in(K8S.rglob("*.yaml")) == {}


# --- the same servers and router as compose -----------------------------------------


@pytest.fixture
def serves(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Serves:
    """manifests.served, bound to this test. pdstack.serve generates the tiny
    models before printing; the comparison needs only the paths it substitutes."""
    models = Path("/cache/pd-models/tiny")
    pair = SimpleNamespace(target=models / "target", draft=models / "draft")
    monkeypatch.setattr("pdstack.tiny_model.ensure_models", lambda *_, **__: pair)
    # The MTP target too: on a new machine generating it would take a minute
    # and print its progress into the output compared.
    monkeypatch.setattr(
        "pdstack.tiny_model.mtp_cache.ensure_mtp_model",
        lambda *_, **__: models / "mtp-target",
    )
    return functools.partial(served, monkeypatch=monkeypatch, capsys=capsys)


# Variables the manifests give the servers beyond compose's, and why.
K8S_ONLY_SERVING_ENV = {
    # pd-ports carries all of ports.env; compose passes the three servers need.
    "ROUTER_PORT",
    "ROUTER_METRICS_PORT",
    # The pod IP that Mooncake advertises to its peers (prefill.yaml).
    "VLLM_HOST_IP",
    # One engine id per prefill replica, the pod name (prefill.yaml); compose
    # runs one prefill, with configs/vllm/prefill.yaml's id.
    "PD_ENGINE_ID",
}
# And the router's: pd-ports again; the URLs themselves are compared apart.
K8S_ONLY_ROUTER_ENV = {"PREFILL_PORT", "DECODE_PORT"}


def env_drift(
    compose: Mapping[str, str], k8s: Mapping[str, str], k8s_only: set[str]
) -> Iterator[str]:
    for name in sorted(compose.keys() | k8s.keys()):
        if name not in k8s:
            yield f"{name}: set by compose only"
        elif name not in compose and name not in k8s_only:
            yield f"{name}: set by the manifests only"
        elif name in compose and compose[name] != k8s[name]:
            yield f"{name}: compose {compose[name]!r}, k8s {k8s[name]!r}"


@pytest.mark.parametrize("role", SERVING)
@each_overlay
def test_servers_run_what_compose_runs(overlay: str, role: str, serves: Serves) -> None:
    service = compose_services(overlay)[role]
    objects = render(overlay)
    container = main_container(workloads(objects)[role])
    # `args` only: the image's ENTRYPOINT (tini, serving-entrypoint) runs, as
    # under compose, which sets no entrypoint either.
    assert "command" not in container and service.get("entrypoint") is None
    assert container["args"] == service["command"]
    theirs, mine = environment(service), container_env(objects, container)
    assert mine["PD_PROFILE"] == overlay
    assert list(env_drift(theirs, mine, K8S_ONLY_SERVING_ENV)) == []
    expected = serves(service["command"], theirs)
    engine_id = mine.pop("PD_ENGINE_ID", None)
    assert serves(container["args"], mine) == expected
    # Each prefill pod's own engine id (its name) is the only difference.
    assert (engine_id is not None) == (role == "prefill")
    if engine_id is not None:
        ours = serves(container["args"], {**mine, "PD_ENGINE_ID": engine_id})
        assert ours == expected.replace(
            '"engine_id":"pd-prefill"', '"engine_id":"<field metadata.name>"'
        )
        assert ours != expected
    # Not vacuous: the printout is vLLM's command line for this role.
    assert "vllm.entrypoints.openai.api_server" in expected
    assert f'"kv_role":"{manifests.KV_ROLE[role]}"' in expected


def test_server_comparison_catches_drift(serves: Serves) -> None:
    service = compose_services("kimi-k2.5")["decode"]
    objects = render("kimi-k2.5")
    configmap(objects, "PD_PROFILE")["data"]["PD_GPU_MEMORY_UTILIZATION"] = "0.5"
    container = main_container(workloads(objects)["decode"])
    container["env"].remove(named(container["env"], "WITH_NVIDIA_PEERMEM"))
    theirs, mine = environment(service), container_env(objects, container)
    assert list(env_drift(theirs, mine, K8S_ONLY_SERVING_ENV)) == [
        "PD_GPU_MEMORY_UTILIZATION: compose '', k8s '0.5'",
        "WITH_NVIDIA_PEERMEM: set by compose only",
    ]
    expected = serves(service["command"], theirs)
    drifted = serves(container["args"], mine)
    assert "--gpu-memory-utilization 0.5" in drifted
    assert drifted != expected
    # A role swapped in the args is caught by the same comparison.
    swapped = [*container["args"][:4], "prefill", *container["args"][5:]]
    assert serves(swapped, theirs) != expected


def router_launch(env: Mapping[str, str]) -> list[str]:
    """vllm-router's argv from pdstack.route, backend URLs replaced by names."""
    argv = route.command(env)
    for flag in ("--prefill", "--decode"):
        argv[argv.index(flag) + 1] = f"<{flag[2:]} url>"
    return argv


@each_overlay
def test_router_runs_what_compose_runs(overlay: str) -> None:
    service = compose_services(overlay)[ROUTER]
    objects = render(overlay)
    container = main_container(workloads(objects)[ROUTER])
    # No command or args: the image's CMD (python3 -m pdstack.route), as compose.
    assert "command" not in container and "args" not in container
    assert service.get("command") is None and service.get("entrypoint") is None
    theirs, mine = environment(service), container_env(objects, container)
    for url in ROUTER_URLS:
        # Hosts differ (compose service names, pod DNS names); the rest not.
        compose_url, k8s_url = (urlsplit(env.pop(url)) for env in (theirs, mine))
        assert compose_url.scheme == k8s_url.scheme, url
        assert (compose_url.port, compose_url.path) == (k8s_url.port, k8s_url.path)
    assert list(env_drift(theirs, mine, K8S_ONLY_ROUTER_ENV)) == []
    fill = {url: "http://backend:1" for url in ROUTER_URLS}
    assert router_launch({**mine, **fill}) == router_launch({**theirs, **fill})


def test_router_comparison_catches_drift() -> None:
    theirs = environment(compose_services("tiny")[ROUTER])
    mine = {**theirs, "ROUTER_METRICS_PORT": "9100", "BOOTSTRAP_PORT": "9000"}
    assert list(env_drift(theirs, mine, K8S_ONLY_ROUTER_ENV)) == [
        "BOOTSTRAP_PORT: compose '8998', k8s '9000'",
        "ROUTER_METRICS_PORT: compose '29000', k8s '9100'",
    ]
    assert router_launch(mine) != router_launch(theirs)


@each_overlay
def test_start_budgets_shm_and_grace_period_cover_compose(overlay: str) -> None:
    objects = render(overlay)
    init = pod(workloads(objects)[ROUTER])["initContainers"][0]
    wait_s = float(container_env(objects, init)["PD_WAIT_TIMEOUT_S"])
    for role, workload in servers(objects):
        spec, service = pod(workload), compose_services(overlay)[role]
        probe = main_container(workload)["startupProbe"]
        budget = float(probe["failureThreshold"] * probe.get("periodSeconds", 10))
        assert budget >= duration_s(service["healthcheck"]["start_period"]), role
        # And the profile's own figure for a cold start (pdstack.sizing).
        wanted = config.profile(overlay).get("start_period") or "30m"
        assert budget >= duration_s(wanted), (role, wanted)
        # The router's wait must outlast the servers' own startup budget.
        assert wait_s >= budget, role
        shm = named(spec["volumes"], "dshm")["emptyDir"]["sizeLimit"]
        assert quantity_bytes(shm) >= int(service["shm_size"])
        grace = duration_s(service["stop_grace_period"])
        assert spec["terminationGracePeriodSeconds"] == grace


def role_neutral(workload: Object) -> Object:
    """A server's pod template with what legitimately differs by role removed:
    the role names, the bootstrap server and the engine id (prefill only) and
    port numbers."""
    text = re.sub("|".join(SERVING), "ROLE", json.dumps(workload["spec"]["template"]))
    template: Object = json.loads(text)
    template["metadata"].pop("annotations", None)
    for container in template["spec"]["containers"]:
        env = container.get("env", [])
        container["env"] = [e for e in env if e["name"] != "PD_ENGINE_ID"]
        kept = [p for p in container.get("ports", []) if p["name"] != "bootstrap"]
        container["ports"] = [{**p, "containerPort": "N"} for p in kept]
    return template


def role_drift(objects: list[Object]) -> list[str]:
    return _differences(*(role_neutral(w) for _, w in servers(objects)), "template")


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        pairs = [(f"{where}.{k}", a.get(k), b.get(k)) for k in sorted({*a, *b})]
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [(f"{where}[{i}]", x, b[i]) for i, x in enumerate(a)]
    else:
        return [] if a == b else [where]
    return [d for path, x, y in pairs for d in _differences(x, y, path)]


@each_overlay
def test_prefill_and_decode_differ_only_by_role(overlay: str) -> None:
    assert role_drift(render(overlay)) == []


def test_role_comparison_catches_drift() -> None:
    objects = render("tiny")
    decode = workloads(objects)["decode"]
    main_container(decode)["resources"]["limits"]["memory"] = "8Gi"
    pod(decode)["terminationGracePeriodSeconds"] = 5
    assert role_drift(objects) == [
        "template.spec.containers[0].resources.limits.memory",
        "template.spec.terminationGracePeriodSeconds",
    ]


# --- overlay specifics ---------------------------------------------------------


@each_overlay
def test_each_overlay_uses_its_transport(overlay: str) -> None:
    protocol = "rdma" if "rdma" in OVERLAYS[overlay][0] else None
    objects = render(overlay)
    for role in SERVING:
        container = main_container(workloads(objects)[role])
        env = container_env(objects, container)
        assert env.get("PD_MOONCAKE_PROTOCOL") == protocol, role
        limits = container["resources"]["limits"]
        assert ("rdma/hca" in limits) == (protocol == "rdma"), role


def test_kimi_keeps_its_model_cache_on_a_claim_per_pod() -> None:
    for _, workload in servers(render("kimi-k2.5")):
        claims = workload["spec"]["volumeClaimTemplates"]
        assert [c["metadata"]["name"] for c in claims] == ["cache"]
        assert "cache" not in {v["name"] for v in pod(workload)["volumes"]}
