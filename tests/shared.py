"""What several tests/ modules share: the twin's shapes, the bench's recorded
run, its settings and report as a test reads them, stub HTTP servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from bench import report, settings
from pdstack.supervisor import HOST

# The CPU twin's target and draft (tests/test_kv_layout.py checks them against
# the generated pair).
MLA_TARGET = {
    "num_hidden_layers": 8,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "num_attention_heads": 4,
    "hidden_size": 256,
}
GQA_DRAFT = {
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
}
SMALL_RUN = Path(__file__).resolve().parent.parent / "bench" / "fixtures" / "small-run"


def bench_settings(argv: list[str] | None = None, **env: str) -> settings.Settings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, env)
    return settings.from_args(parser.parse_args(argv or []))


def built(run_dir: Path) -> tuple[dict[str, Any], str]:
    """report.build's summary of a run directory and the report.md it wrote."""
    return report.build(run_dir), (run_dir / "report.md").read_text()


@contextlib.contextmanager
def serving(apps: dict[int, web.Application], **options: Any) -> Iterator[None]:
    """Each app on its loopback port (port -> app), served by an event loop in
    a daemon thread; ``options`` go to web.AppRunner."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(step: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(step, loop).result(timeout=30)

    runners = [web.AppRunner(app, **options) for app in apps.values()]
    for runner, port in zip(runners, apps, strict=True):
        run(runner.setup())
        run(web.TCPSite(runner, HOST, port).start())
    try:
        yield
    finally:
        for runner in runners:
            run(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
