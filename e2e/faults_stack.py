"""The fault suite's own stack (configs/faults.yaml): started once per session
for every fault module, which load this file as a plugin
(``pytest_plugins = ["faults_stack"]``): a fixture imported into several
modules would start one stack per module. The fault cases run after the
others, so the stack is down again as soon as they are done; at the end it
prints the results table (faults_helpers.record).

On the CPU twin it starts its own servers, on the session twin's ports moved
by configs/faults.yaml's offsets, so it may kill and restart them without
disturbing the session stack. Against a stack given by URLs it hands that
stack over; the cases that would kill something skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from unittest import mock

import pytest

import faults_helpers as fh
from conftest import FAULT_FILE_ENV, require_full_install, twin_epsilon
from pdstack import config, supervisor, twin

# Development: PD_FAULTS_KEEP=1 leaves the fault stack running after the
# session and reuses it on the next run (restarted roles stay restarted).
KEEP_ENV = "PD_FAULTS_KEEP"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fault cases last, in their order: a session fixture goes down at
    the session's end, so their stack then lives only as long as they run."""
    items.sort(key=lambda item: "faults" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def faults(request: pytest.FixtureRequest) -> Iterator[fh.FaultStack]:
    """The stack the fault cases break, with its idle state and bounds."""
    cfg = fh.settings()
    bounds, launch = fh.stack_settings(cfg)
    if request.config.getoption("router_url"):
        # The stack given by URLs (conftest's), with the fault suite's bounds.
        given = fh.FaultStack(**vars(request.getfixturevalue("stack")), bounds=bounds)
        given.idle = fh.idle_state(given)
        yield given
        fh.print_table()
        return
    require_full_install("the fault suite's own CPU twin")
    # The fault stack's port variables (configs/ports.env's names): the
    # session twin's ports, moved.
    base = config.ports()
    env = {
        name: str(getattr(base, field) + cfg["port_offsets"].get(name, 0))
        for field, name in config.port_variables().items()
    }
    # Prefill's side channel listens beside its bootstrap port: free it too.
    wanted = [*map(int, env.values()), config.ports(env).side_channel]
    busy = [port for port in wanted if supervisor.port_in_use(port)]
    if busy and not os.environ.get(KEEP_ENV):
        pytest.fail(f"fault stack ports in use: {busy} (configs/faults.yaml offsets)")
    fh.RUN_DIR.mkdir(parents=True, exist_ok=True)
    keep = os.environ.get(KEEP_ENV) == "1"
    # Decode's fault switch, off: the negative control of the comparison
    # every case makes of its answers with the reference turns it on.
    fault_file = fh.RUN_DIR / "fault"
    fault_file.unlink(missing_ok=True)
    decode_env = launch["role_env"].setdefault("decode", {})
    decode_env[FAULT_FILE_ENV] = str(fault_file)
    # pdstack reads the ports from the environment.
    with mock.patch.dict(os.environ, env):
        if keep and set(twin.running(fh.RUN_DIR)) == {*config.ROLES, "router"}:
            urls = twin.urls()  # reuse the kept stack (development only)
        else:
            urls = twin.up(run_dir=fh.RUN_DIR, progress=fh.progress, **launch)
    stack = fh.FaultStack(
        urls.router,
        urls.prefill,
        urls.decode,
        urls.prefill,
        owned=True,
        run_dir=fh.RUN_DIR,
        env=env,
        bootstrap=f"http://{twin.HOST}:{urls.bootstrap_port}",
        bounds=bounds,
        role_env=launch["role_env"],
        fault_file=fault_file,
        # As the session's twin: exact where it serves float32.
        epsilon=twin_epsilon(),
    )
    try:
        stack.idle = fh.idle_state(stack)
        yield stack
    finally:
        if not keep:
            with mock.patch.dict(os.environ, env):
                twin.down(fh.RUN_DIR, progress=fh.progress)
        fh.print_table()
