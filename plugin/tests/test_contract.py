"""The plugin's contract with upstream vLLM: every overridden, called or read
upstream name exists with the signature the plugin needs, upstream's own
construction path builds our worker, and the sibling transfer-id derivation
understands the request ids vLLM itself makes.

``PD_MOONCAKE_VLLM_SOURCE`` may name an unpacked vLLM release (the directory
holding its ``vllm/`` package, e.g. a wheel unzipped into /tmp): the same
checks then also run on that release's source, parsed and never imported.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import inspect
import logging
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_metrics import prom_metrics
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as upstream,
)

from conftest import kv_cache_config
from pd_mooncake import CONNECTOR_NAME, cpu_support, fixes, metrics, reliability
from pd_mooncake.connector import PDMooncakeConnector, PDMooncakeConnectorWorker
from pd_mooncake.fixes_report import view_of
from pd_mooncake.upstream_source import BASE_FILE, CONNECTOR_FILE

SOURCE_ENV = "PD_MOONCAKE_VLLM_SOURCE"
INSTALLED = Path(upstream.__file__).parents[6]  # the directory holding vllm/


def other_release() -> Path:
    root = os.environ.get(SOURCE_ENV)
    if not root:
        pytest.skip(f"{SOURCE_ENV} not set: no other vLLM release's source to check")
    if not (Path(root) / CONNECTOR_FILE).is_file():
        pytest.skip(f"{SOURCE_ENV}={root} has no {CONNECTOR_FILE}")
    return Path(root)


@pytest.fixture(params=["installed", "other"])
def release(request: pytest.FixtureRequest) -> Path:
    return INSTALLED if request.param == "installed" else other_release()


# --- names and signatures ------------------------------------------------------------


# Fixes known not to attach to the other release (comma-separated; make
# test-compat names them per release): exactly these, no more, no fewer.
EXPECT_MISSING_ENV = "PD_MOONCAKE_EXPECT_MISSING"


def test_every_fix_attaches(release: Path) -> None:
    report = fixes.check(view_of(release))
    print(report.line())
    expected = set()
    if release != INSTALLED:
        expected = {
            f.strip()
            for f in os.environ.get(EXPECT_MISSING_ENV, "").split(",")
            if f.strip()
        }
    assert set(report.missing) == expected, report.line()


def test_the_source_check_agrees_with_the_live_classes() -> None:
    """The ast reading of the installed source gives the signatures that
    ``inspect`` reads from the imported classes (the checker reads right)."""
    owners = {"": upstream, **vars(upstream)}
    checked = 0
    for fix in fixes.FIXES:
        for need in fix.needs:
            if not isinstance(need, fixes.Method):
                continue
            obj = getattr(owners[need.owner] if need.owner else upstream, need.name)
            params = tuple(inspect.signature(obj).parameters)
            params = params[1:] if need.owner else params
            if need.leading:
                params = params[: len(need.params)]
            assert params == need.params, need
            assert inspect.iscoroutinefunction(obj) == need.is_async, need
            checked += 1
    assert checked >= 15


def test_our_overrides_match_what_the_contract_checks() -> None:
    """Each override the plugin defines has the parameters the contract lists
    (the contract is about our code, not a hand-typed copy of upstream's)."""
    for fix in fixes.FIXES:
        for need in fix.needs:
            if not isinstance(need, fixes.Method) or not need.owner:
                continue
            ours = {
                fixes.WORKER: PDMooncakeConnectorWorker,
                fixes.CONNECTOR: PDMooncakeConnector,
            }.get(need.owner)
            if ours is None or need.name not in vars(ours):
                continue
            params = tuple(inspect.signature(vars(ours)[need.name]).parameters)[1:]
            if need.name == "__init__":
                continue  # ours take *args, **kwargs through to upstream's
            assert params == need.params, (need.name, params)


@pytest.mark.parametrize(
    ("edit", "fix", "problem"),
    [
        (("def _send_blocks(", "def _send_blocks_sync("), "send_retry", "missing"),
        (
            (
                "        lengths: list[int],\n    ) -> int:",
                "        lengths: list[int],\n        timeout_s: float,\n    ) -> int:",
            ),
            "send_retry",
            "the plugin needs",
        ),
        (
            (
                "self.xfer_stats.record_failed_transfer()",
                "self.xfer_stats.record_failure()",
            ),
            "send_retry",
            "no longer calls",
        ),
        (
            (
                "self.connector_worker = MooncakeConnectorWorker(",
                "self.connector_worker = _worker_cls()(",
            ),
            "worker_class",
            "no longer calls MooncakeConnectorWorker",
        ),
        (
            ("async def record_send_reqs(", "def record_send_reqs("),
            "not_processed_guard",
            "the plugin needs async",
        ),
        (
            ("self.reqs_need_send", "self.pending_sends"),
            "rejection_release",
            "never set",
        ),
    ],
)
def test_negative_control_a_changed_upstream_is_reported(
    edit: tuple[str, str], fix: str, problem: str
) -> None:
    source = (INSTALLED / CONNECTOR_FILE).read_text()
    assert edit[0] in source
    changed = source.replace(edit[0], edit[1])
    report = fixes.check(fixes.SourceView(changed, (INSTALLED / BASE_FILE).read_text()))
    assert fix in report.missing, report.line()
    assert any(problem in p for p in report.missing[fix]), report.missing[fix]


# --- start-up: one line, and a refusal -----------------------------------------------


def broken_view() -> fixes.SourceView:
    source = (INSTALLED / CONNECTOR_FILE).read_text()
    return fixes.SourceView(
        source.replace("def _send_blocks(", "def _send_blocks_sync("),
        (INSTALLED / BASE_FILE).read_text(),
    )


def test_start_up_logs_one_line_naming_the_attached_fixes(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.pd_mooncake"):
        fixes.enforce({}, producer=True, consumer=False)
    lines = [r.getMessage() for r in caplog.records if "fixes attached" in r.message]
    assert len(lines) == 1
    assert lines[0].startswith("PD Mooncake fixes attached: worker_class, ")
    assert "NOT attached" not in lines[0]
    assert lines[0].endswith("transfer metrics: plugin")


def test_a_relied_on_fix_that_cannot_attach_stops_start_up(monkeypatch) -> None:
    monkeypatch.delenv(fixes.ALLOW_ENV, raising=False)
    with pytest.raises(
        fixes.FixNotAttachedError, match=r"send_retry: .*_send_blocks is missing"
    ):
        fixes.enforce({}, producer=True, consumer=False, view=broken_view())


def test_a_fix_the_configuration_does_not_use_may_be_missing(monkeypatch) -> None:
    """Decode never sends: a missing send fix does not stop it."""
    monkeypatch.delenv(fixes.ALLOW_ENV, raising=False)
    report = fixes.enforce({}, producer=False, consumer=True, view=broken_view())
    assert "send_retry" in report.missing


def test_an_explicit_setting_allows_a_missing_fix(monkeypatch) -> None:
    monkeypatch.setenv(fixes.ALLOW_ENV, "send_retry")
    report = fixes.enforce({}, producer=True, consumer=False, view=broken_view())
    assert "send_retry" in report.missing


def test_the_connector_refuses_to_start_on_a_broken_contract(monkeypatch) -> None:
    monkeypatch.delenv(fixes.ALLOW_ENV, raising=False)
    monkeypatch.setattr(fixes, "installed_view", broken_view)
    with pytest.raises(fixes.FixNotAttachedError):
        PDMooncakeConnector(
            vllm_config("kv_producer"), KVConnectorRole.SCHEDULER, kv_cache_config()
        )


# --- upstream's construction path builds our worker ----------------------------------


def vllm_config(role: str) -> VllmConfig:
    kv = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role=role,
        engine_id="pd-contract",
        kv_connector_extra_config={"mooncake_protocol": "tcp"},
    )
    return VllmConfig(kv_transfer_config=kv)


def worker_built_by(connector_cls: type) -> type:
    """The class of the worker upstream's ``MooncakeConnector.__init__``
    instantiates. The worker's constructor runs for real (Mooncake engine
    included) until it needs vLLM's tensor-parallel group, which a test
    process has not initialised; its frame shows what was built."""
    with pytest.raises(AssertionError, match="tensor model parallel") as caught:
        connector_cls(
            vllm_config("kv_consumer"), KVConnectorRole.WORKER, kv_cache_config()
        )
    tb = caught.value.__traceback__
    built = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is upstream.MooncakeConnectorWorker.__init__.__code__:
            built = type(frame.f_locals["self"])
            # What shutdown() (run by __del__) touches on a half-built worker.
            frame.f_locals["self"].async_zmq_ctx = upstream.zmq.asyncio.Context()
        tb = tb.tb_next
    assert built is not None, "upstream's worker constructor never ran"
    # Collect the half-built worker now: a finalizer the collector runs in
    # the middle of a later ast.parse breaks CPython 3.11.7's parser
    # ("AST constructor recursion depth mismatch").
    del tb, caught, frame
    gc.collect()
    return built


def test_upstream_construction_builds_our_worker() -> None:
    assert worker_built_by(PDMooncakeConnector) is PDMooncakeConnectorWorker
    # The swap is scoped to the construction.
    assert upstream.MooncakeConnectorWorker.__module__ == upstream.__name__


def test_negative_control_upstream_alone_builds_its_own_worker() -> None:
    # Upstream's worker needs an accelerator index; ours provides it on CPU.
    with cpu_support.cpu_device_index():
        built = worker_built_by(upstream.MooncakeConnector)
    assert built is upstream.MooncakeConnectorWorker


# --- sibling transfer ids from vLLM's own request ids --------------------------------
# vllm-router's API request id (X-Request-Id), as vLLM gets it on both legs.
API_ID = "___prefill_addr_10.0.0.1:8100___decode_addr_10.0.0.2:8200_42e4"


def fstring_assigned(root: Path, path: str, target: str) -> ast.expr:
    """The f-string vLLM's source assigns to ``target`` (the last branch of a
    conditional: the one used for several prompts)."""
    tree = ast.parse((root / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == target:
            value = node.value
            if isinstance(value, ast.IfExp):
                value = value.orelse
            if isinstance(value, ast.JoinedStr):
                return value
    raise AssertionError(f"{path}: no f-string assigned to {target}")


def made_by(root: Path, path: str, target: str, **names: Any) -> str:
    expr = ast.Expression(fstring_assigned(root, path, target))
    return eval(compile(expr, path, "eval"), {}, names)


def engine_ids(
    root: Path, api: str, path: str, target: str, prompts: int, n: int
) -> list[str]:
    """Engine request ids of one API request, made by the release's own
    expressions: serving (per prompt), input processor (random suffix),
    parallel sampling (child index)."""
    from vllm.utils import random_uuid

    out = []
    for i in range(prompts):
        item = made_by(root, path, target, request_id=api, i=i) if prompts > 1 else api
        request = SimpleNamespace(external_req_id=item)
        randomized = made_by(
            root,
            "vllm/v1/engine/input_processor.py",
            "request.request_id",
            request=request,
            random_uuid=random_uuid,
        )
        for k in range(n):
            child = made_by(
                root,
                "vllm/v1/engine/parallel_sampling.py",
                "child_req_id",
                index=k,
                self=SimpleNamespace(request_id=randomized),
            )
            out.append(child if n > 1 else randomized)
    return out


SERVING = {
    "completion": (
        "cmpl-",
        "vllm/entrypoints/openai/completion/serving.py",
        "request_id_item",
    ),
    "chat": (
        "chatcmpl-",
        "vllm/entrypoints/openai/chat_completion/serving.py",
        "sub_request_id",
    ),
}


@pytest.mark.parametrize(
    ("api", "prompts", "n"),
    [
        ("completion", 3, 1),
        ("completion", 2, 3),
        ("completion", 1, 4),
        ("chat", 1, 3),
        # Chat names several prompts '<id>_<i>' (completions '<id>-<i>').
        ("chat", 3, 1),
    ],
)
def test_siblings_own_ids_equal_on_both_legs(
    release: Path, api: str, prompts: int, n: int
) -> None:
    prefix, path, target = SERVING[api]
    derive = reliability.sibling_transfer_id
    legs = [
        [
            derive("xfer", rid)
            for rid in engine_ids(release, prefix + API_ID, path, target, prompts, n)
        ]
        for _ in ("prefill", "decode")
    ]
    assert legs[0] == legs[1]
    assert len(set(legs[0])) == prompts * n, legs[0]
    assert legs[0][0] == "xfer"  # a single request keeps the router's id


def test_the_source_made_ids_are_what_the_installed_vllm_makes() -> None:
    """The expressions read from source make the ids the imported code
    makes (input processor and parallel sampling run for real)."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.parallel_sampling import ParentRequest

    request = EngineCoreRequest(
        request_id=f"cmpl-{API_ID}-1",
        prompt_token_ids=[1, 2],
        mm_features=None,
        sampling_params=SamplingParams(n=2),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    InputProcessor.assign_request_id(request)
    live_child, _ = ParentRequest(request).get_child_info(1)
    made = engine_ids(INSTALLED, f"cmpl-{API_ID}", *SERVING["completion"][1:], 2, 2)
    assert live_child[:-8] == made[3][:-8]
    assert reliability.sibling_transfer_id("xfer", live_child) == "xfer~1.1"


# --- metrics: no second copy of upstream's series ------------------------------------


def load_stats_module(root: Path) -> ModuleType:
    """A release's Mooncake stats module, run on the installed vLLM (its
    imports exist there); skipped where it has no Prometheus metrics."""
    path = root / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/stats.py"
    spec = importlib.util.spec_from_file_location("pd_contract_stats", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    if not hasattr(module, "MooncakePromMetrics"):
        pytest.skip(f"{root} has no upstream MooncakePromMetrics")
    return module


def published(upstream_cls: type | None, monkeypatch) -> dict[str, float]:
    monkeypatch.setattr(fixes, "upstream_prom_metrics", lambda: upstream_cls)
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    stats = metrics.PDMooncakeStats()
    stats.record_transfer(0.002, 600, 3)
    stats.record_failed_transfer()
    stats.record_retry()
    prom.observe(stats.clone_and_reset().data, 0)
    return {
        s.name: s.value
        for f in registry.collect()
        for s in f.samples
        if not s.labels.get("le")
    }


OUR_COPIES = {
    "vllm:mooncake_transfers_total",
    "vllm:mooncake_bytes_transferred_total",
    "vllm:mooncake_descriptors_total",
    "vllm:mooncake_failed_transfers_total",
    "vllm:mooncake_failed_recvs_total",
    "vllm:mooncake_expired_requests_total",
    "vllm:mooncake_transfer_time_seconds_count",
    "vllm:mooncake_transfer_size_bytes_count",
}


def test_where_upstream_has_mooncake_metrics_ours_add_only_the_rest(
    monkeypatch,
) -> None:
    module = load_stats_module(other_release())
    values = published(module.MooncakePromMetrics, monkeypatch)
    assert not OUR_COPIES & set(values), sorted(OUR_COPIES & set(values))
    # Upstream's series carry the numbers; ours only what upstream lacks.
    assert values["vllm:mooncake_xfer_time_seconds_count"] == 1
    assert values["vllm:mooncake_bytes_transferred_sum"] == 600
    assert values["vllm:mooncake_num_failed_transfers_total"] == 1
    assert values["vllm:mooncake_retried_transfers_total"] == 1


def test_negative_control_without_upstream_metrics_ours_are_published(
    monkeypatch,
) -> None:
    values = published(None, monkeypatch)
    assert set(values) >= OUR_COPIES
    assert fixes.upstream_prom_metrics() is None  # vLLM 0.32 has none


def test_the_dashboard_mapping_names_every_series_upstream_owns() -> None:
    ours = {
        name.strip()
        for left, _ in metrics.UPSTREAM_SERIES.values()
        for name in left.split(",")
    }
    assert {n.removesuffix("_count") for n in OUR_COPIES} == ours
    assert set(metrics.UPSTREAM_SERIES) == {
        key for _, key, _ in metrics.COUNTERS if key not in metrics.OWN_COUNTERS
    }


def test_base_module_is_the_one_parsed() -> None:
    assert Path(base.__file__) == INSTALLED / BASE_FILE
