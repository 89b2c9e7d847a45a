"""A profile's Kubernetes overlay, k8s/overlays/<profile>/, written from what
the profile needs: its GPUs per pod, its start-up budget, the transport.

The base (k8s/base) runs one GPU per role with a 30 min startup budget. An
overlay names the profile (the pd-serving ConfigMap, as compose's .env does)
and patches prefill and decode alike: GPUs, startupProbe budget, and for more
than one GPU a node to itself (podAntiAffinity), more host memory and
/dev/shm; for a whole node, the node's GPU count and a model-cache claim per
pod. tests/test_k8s.py renders every overlay and holds it to the profile.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import yaml

from pdstack import sizing

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / "k8s" / "overlays"
BASE_BUDGET_S = 1800  # k8s/base's startupProbe: 180 x 10 s
PROBE_PERIOD_S = 10
BASE_MEMORY_GI = 32  # k8s/base's memory limit of a server
HOST_GPUS = sizing.HOST_GPUS

SERVING_ENV = """\
# Read by pdstack.serve in prefill and decode (compose: .env).
# configs/profiles/{name}.yaml
PD_PROFILE={name}
# Empty: the profile's gpu-memory-utilization, else vLLM's default.
PD_GPU_MEMORY_UTILIZATION=
# 0 skips the GPU preflight before vLLM starts (docs/gpu.md).
PD_PREFLIGHT=1
# 0 turns the KV checksum off on both roles (empty: configs/vllm, on).
PD_MOONCAKE_KV_CHECKSUM=
# MiB of the KV staging buffer (empty: configs/vllm, 256; 0: without it).
PD_MOONCAKE_KV_STAGING_MIB=
"""


def write(
    name: str,
    gpus: int,
    start_budget_s: int,
    weight_bytes: int,
    rdma: bool,
    summary: str,
) -> list[Path]:
    """Writes k8s/overlays/<name>/; returns the files written."""
    folder = OVERLAYS / name
    folder.mkdir(parents=True, exist_ok=True)
    budget = max(start_budget_s, BASE_BUDGET_S)
    files = {
        "kustomization.yaml": kustomization(name, summary, rdma, budget),
        "serving.env": SERVING_ENV.format(name=name),
        "serving.yaml": _dump(
            f"Prefill and decode of profile {name}: {gpus} GPU(s) each, a "
            f"startup budget of {sizing.duration(budget)} "
            f"({budget // PROBE_PERIOD_S} x {PROBE_PERIOD_S} s).",
            serving_patch(gpus, budget, weight_bytes),
        ),
    }
    if budget > BASE_BUDGET_S:
        files["router.yaml"] = _dump(
            "The router waits as long as the servers may take to start.",
            router_patch(budget),
        )
    for file, text in files.items():
        (folder / file).write_text(text)
    return [folder / file for file in files]


def kustomization(name: str, summary: str, rdma: bool, budget: int) -> str:
    data: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["../../base"],
    }
    if rdma:
        data["components"] = ["../../components/rdma"]
    data["configMapGenerator"] = [{"name": "pd-serving", "envs": ["serving.env"]}]
    patches: list[dict[str, Any]] = [
        {
            "path": "serving.yaml",
            "target": {
                "kind": "StatefulSet",
                "labelSelector": "app.kubernetes.io/component in (prefill,decode)",
            },
        }
    ]
    if budget > BASE_BUDGET_S:
        patches.append(
            {"path": "router.yaml", "target": {"kind": "Deployment", "name": "router"}}
        )
    data["patches"] = patches
    header = (
        f"Profile {name}: {summary}. Written by `python -m pdstack.profile` "
        "(docs/models.md); docs/kubernetes.md deploys it:\n"
        f"kubectl apply -k k8s/overlays/{name}"
    )
    return _dump(header, data)


def serving_patch(gpus: int, budget: int, weight_bytes: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "vllm",
        "startupProbe": {"failureThreshold": budget // PROBE_PERIOD_S},
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
    }
    pod: dict[str, Any] = {"containers": [container]}
    spec: dict[str, Any] = {"template": {"spec": pod}}
    # Host memory to stage the weights while they load (the base: 32Gi).
    memory_gi = 2 ** math.ceil(math.log2(weight_bytes / sizing.GIB + 1))
    if memory_gi > BASE_MEMORY_GI:
        container["resources"]["requests"] = {
            "cpu": str(max(4, 8 * gpus)),
            "memory": f"{memory_gi // 2}Gi",
        }
        container["resources"]["limits"]["memory"] = f"{memory_gi}Gi"
    if gpus > 1:
        # Never two serving pods on one node: each takes the node's GPUs,
        # NICs and memory bandwidth (tests/test_k8s.py, placement).
        pod["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {
                            "matchExpressions": [
                                {
                                    "key": "app.kubernetes.io/name",
                                    "operator": "In",
                                    "values": ["pd-mooncake"],
                                },
                                {
                                    "key": "app.kubernetes.io/component",
                                    "operator": "In",
                                    "values": ["prefill", "decode"],
                                },
                            ]
                        },
                    }
                ]
            }
        }
        # NCCL's buffers between the pod's GPUs (the base: 16Gi).
        pod["volumes"] = [
            {
                "name": "dshm",
                "emptyDir": {
                    "medium": "Memory",
                    "sizeLimit": f"{max(16, 8 * gpus)}Gi",
                },
            }
        ]
    if gpus >= HOST_GPUS:
        # A whole node: the label NVIDIA GPU Feature Discovery sets; and the
        # weights on a claim per pod, so a restart does not download again.
        pod["nodeSelector"] = {"nvidia.com/gpu.count": str(gpus)}
        pod["volumes"].append({"name": "cache", "$patch": "delete"})
        storage = math.ceil(2.5 * weight_bytes / sizing.GIB / 100) * 100
        spec["volumeClaimTemplates"] = [
            {
                "metadata": {"name": "cache"},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": f"{storage}Gi"}},
                },
            }
        ]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "serving"},
        "spec": spec,
    }


def router_patch(budget: int) -> dict[str, Any]:
    wait = {"name": "PD_WAIT_TIMEOUT_S", "value": str(budget)}
    init = {"name": "wait-for-backends", "env": [wait]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "router"},
        "spec": {"template": {"spec": {"initContainers": [init]}}},
    }


def _dump(header: str, data: dict[str, Any]) -> str:
    lines = [w for line in header.splitlines() for w in textwrap.wrap(line, 76)]
    comment = "".join(f"# {line}\n" for line in lines)
    return comment + yaml.safe_dump(data, sort_keys=False)
