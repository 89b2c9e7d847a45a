"""bench.transfer_cost: the descriptor bound, the CPU-per-GiB ratio and the
/proc thread accounting they are judged on (docs/bench.md, "Transfer cost")."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench import kv_checksum, kv_path, targets
from bench import transfer_cost as tc
from pd_mooncake import staging

MIB = 1 << 20
GIB = 1 << 30
REGIONS = 9


def sample(descriptors: float, nbytes: float, state: str = "staged",
           cpu: float = 0.0, idle: float = 0.0) -> tc.Sample:  # fmt: skip
    return tc.Sample(
        state, "fragmented", 4096,
        {"bytes": nbytes, "descriptors": descriptors, "gather_seconds": 0.01},
        {"prefill": cpu / 2, "decode": cpu / 2}, {"prefill": idle, "decode": 0.0}, 1.0,
    )  # fmt: skip


def test_bound_is_megabytes_plus_one_per_region() -> None:
    result = tc.Result([], REGIONS, {})
    assert result.bound(10 * MIB) == 10 + REGIONS
    assert result.bound(10 * MIB + 1) == 11 + REGIONS
    assert staging.CHUNK_BYTES == MIB  # the bound's unit is the staged chunk


def test_an_over_count_is_flagged_and_misses_the_target() -> None:
    within = sample(10 + REGIONS, 10 * MIB)
    over = sample(11 + REGIONS, 10 * MIB)
    direct = sample(500, 10 * MIB, state="direct")  # direct is compared, not judged
    assert tc.Result([within, direct], REGIONS, {}).over_bound() == []
    result = tc.Result([within, over, direct], REGIONS, {})
    assert result.over_bound() == [over]
    verdict = targets._descriptor_target(result)
    assert verdict.met is False and verdict.measured.startswith("1 of 2 within")
    assert verdict.advice.startswith("A staged request took more")
    assert targets._descriptor_target(tc.Result([within], REGIONS, {})).met is True


def test_no_regions_or_no_staged_request_is_not_measured() -> None:
    assert targets._descriptor_target(None).met is None
    assert targets._descriptor_target(tc.Result([sample(1, MIB)], None, {})).met is None
    direct_only = tc.Result([sample(1, MIB, state="direct")], REGIONS, {})
    assert targets._descriptor_target(direct_only).met is None


def test_cpu_ratio_net_of_idle_against_the_engine_for_the_same_bytes() -> None:
    gib = float(1 << 30)
    engine = {int(gib): 2.0 / gib}  # 2 CPU-s per GiB alone
    # 3.5 CPU-s used, 0.5 of it the threads' idle rate: 3.0 net, 1.5x.
    at_limit = tc.Result([sample(1, gib, cpu=3.5, idle=0.5)], REGIONS, engine)
    figures = at_limit.cpu_per_gib("staged")
    assert (figures["raw"], figures["net"], figures["engine_alone"]) == (3.5, 3.0, 2.0)
    assert figures["ratio"] == 1.5
    assert targets._cpu_target(at_limit).met is True
    over = tc.Result([sample(1, gib, cpu=3.6, idle=0.5)], REGIONS, engine)
    verdict = targets._cpu_target(over)
    assert verdict.met is False and verdict.measured.startswith("1.55x")
    assert targets._cpu_target(tc.Result([sample(1, gib)], REGIONS, {})).met is None


def test_the_engine_alone_is_also_compared_without_its_callers_spin() -> None:
    """batch_transfer_sync_write spins in its caller (the engine alone's
    sender main thread) and the plugin's sends do not: the ratio against
    the engine's own threads is reported beside the judged one, and so is
    the staged state with the KV checksum off."""
    gib = float(1 << 30)
    staged = sample(1, gib, cpu=3.0)
    unchecked = tc.Sample(**{**staged.__dict__, "state": tc.UNCHECKED,
                             "cpu_s": {"prefill": 1.0, "decode": 1.0}})  # fmt: skip
    result = tc.Result([staged, unchecked], REGIONS, {int(gib): 2.0 / gib}, {},
                       {int(gib): 1.0 / gib})  # fmt: skip
    figures = result.cpu_per_gib("staged")
    assert (figures["ratio"], figures["engine_threads"], figures["ratio_threads"]) == (
        1.5, 1.0, 3.0,
    )  # fmt: skip
    verdict = targets._cpu_target(result)
    assert verdict.met is True and verdict.measured.startswith("1.50x")
    assert "against the engine's own threads (1.00): 3.00x" in verdict.note
    assert "KV checksum off: 2.00 CPU-s/GiB, 1.00x" in verdict.note
    assert tc.STATE_ENV[tc.UNCHECKED] == {kv_checksum.ENV: "0"}
    assert tc.STATES[: len(kv_path.STATES)] == kv_path.STATES  # their seeds kept


def test_each_pass_is_judged_against_the_engine_measured_right_after_it() -> None:
    """The machine's speed moves between passes minutes apart: a sample is
    compared with its own pass's reference, and only without one with the
    run's."""
    gib = float(1 << 30)
    fresh = tc.Sample(**{**sample(1, gib, cpu=3.0).__dict__, "name": "fresh"})
    fragmented = sample(1, gib, cpu=6.0)  # the machine twice as slow then
    references = [
        tc.Reference("staged", "fresh", {int(gib): 2.0 / gib}, {int(gib): 1.0 / gib}),
        tc.Reference("staged", "fragmented", {int(gib): 4.0 / gib}, {}),
    ]
    result = tc.Result([fresh, fragmented], REGIONS, {int(gib): 1.0 / gib}, {}, {},
                       references)  # fmt: skip
    assert result.cpu_per_gib("staged", "fresh")["ratio"] == 1.5
    assert result.cpu_per_gib("staged", "fragmented")["ratio"] == 1.5
    figures = result.cpu_per_gib("staged")
    assert (figures["engine_alone"], figures["ratio"]) == (3.0, 1.5)
    assert figures["engine_threads"] is None  # the fragmented pass has none
    assert targets._cpu_target(result).met is True
    # Against the run's reference alone the same samples miss it (4.5x).
    run_only = tc.Result([fresh, fragmented], REGIONS, {int(gib): 1.0 / gib})
    assert targets._cpu_target(run_only).measured.startswith("4.50x")
    direct = tc.Sample(**{**fresh.__dict__, "state": "direct"})
    assert tc.Result([direct], REGIONS, {int(gib): 1.0 / gib}, {}, {},
                     references).cpu_per_gib("direct")["ratio"] == 3.0  # fmt: skip


def test_the_engine_alone_counts_its_callers_spin_apart() -> None:
    """Two real loopback engines: the sender's main thread, which waits in
    batch_transfer_sync_write, burns CPU that the engine's own threads do
    not include."""
    size = 8 << 20
    whole, own = tc.engine_cpu([size], least=64 << 20)
    print(f"engine alone: {whole[size] * GIB:.2f} CPU-s/GiB, own threads "
          f"{own[size] * GIB:.2f}")  # fmt: skip
    assert 0 < own[size] < whole[size]


def test_ladder_runs_from_128_tokens_to_the_longest_prompt() -> None:
    assert tc.ladder(8192, quick=True) == [128, 1024, 8192 - tc.OUTPUT_TOKENS]
    full = tc.ladder(8192, quick=False)
    assert full[0] == 128 and full[-1] == 8192 - tc.OUTPUT_TOKENS
    assert full == sorted(set(full))


def test_transfer_threads_are_the_unnamed_non_main_threads_from_proc() -> None:
    """Real /proc: a busy unnamed thread (Mooncake's and the connector's
    carry the process's name) is counted; the main thread's work (the
    forward pass's place in a server) and a named thread's (gloo, ZeroMQ)
    are not."""

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def named() -> None:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text("gloo_t")
        spin(0.3)
        event.wait(10)

    pid = os.getpid()
    # A thread's time leaves /proc with it: read while the busy ones live.
    event = threading.Event()
    busy = [
        threading.Thread(target=lambda: (spin(0.3), event.wait(10))),
        threading.Thread(target=named),
    ]
    before = tc.thread_cpu(pid)
    for thread in busy:
        thread.start()
    spin(0.3)
    time.sleep(0.6)
    after = tc.thread_cpu(pid)
    event.set()
    for thread in busy:
        thread.join()
    counted = tc.transfer_seconds(pid, before, after)
    assert 0.2 <= counted <= 0.45, counted
    assert tc.by_name(before, after)["gloo_t"] >= 0.2


def test_the_run_file_round_trips(tmp_path: Path) -> None:
    references = [tc.Reference("staged", "fresh", {MIB: 2e-9}, {MIB: 1e-9})]
    result = tc.Result([sample(19, 10 * MIB)], REGIONS, {10 * MIB: 1e-9}, {"x": 1},
                       {10 * MIB: 5e-10}, references)  # fmt: skip
    tc.write(tmp_path, result)
    again = tc.read(tmp_path)
    assert again is not None and again.samples == result.samples
    assert again.engine_cpu_per_byte == result.engine_cpu_per_byte
    assert again.engine_threads_per_byte == result.engine_threads_per_byte
    assert again.references == references
    assert "NO" not in "\n".join(tc.markdown(again))
    assert tc.read(tmp_path / "none") is None


def test_the_report_has_the_section_and_both_targets(tmp_path: Path) -> None:
    from bench import report

    over = sample(11 + REGIONS, 10 * MIB, cpu=1.0)  # 102 CPU-s/GiB against 1.07
    result = tc.Result([over], REGIONS, {10 * MIB: 1e-9})
    tc.write(tmp_path, result)
    summary = report.build(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert f"## {tc.TITLE}" in text and "| NO |" in text
    judged = {t["name"]: t["met"] for t in summary["targets"]}
    cost = {n: met for n, met in judged.items() if n.startswith("KV transfer cost")}
    assert list(cost.values()) == [False, False], cost
    assert summary["transfer_cost"]["requests"][0]["bound"] == 10 + REGIONS
