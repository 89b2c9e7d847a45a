"""The GPU data path of KV staging, checked end to end in two processes
(``scripts/gpu-datapath-check``; docs/gpu.md, "KV staging memory").

Prefill (this process) and decode (a spawned one) each hold bf16 KV caches
laid out as vLLM lays them out for the target's FlashMLA (per layer
``(blocks, 64, 576)``) and the draft's FlashAttention (``(2, blocks, 64, 8,
128)``: K and V apart), and a real Mooncake TransferEngine on TCP over
loopback with the caches and a staging buffer registered. One request's
blocks, fragmented lists on both sides, go as the plugin stages them:
prefill's indexed gather (pd_mooncake.device_copy, on its staging stream
after a KV-ready mark of the forward stream) into a record (pd_mooncake.staging),
the record written in ``CHUNK_BYTES`` descriptors, decode's scatter into its
blocks; then decode's checksum digests (pd_mooncake.kv_digest) and a hash of
the landed bytes against prefill's.

Whether the forward stream was waited on: on CUDA, a busy "forward step" is
enqueued on the forward stream after the mark, and the gather must return
while it still runs; on both, ``torch.cuda.synchronize`` is counted (must
stay 0). Without CUDA the same code runs on CPU tensors with the stand-ins
recording every stream call (``make test``).

Needs PyTorch, numpy and ``mooncake.engine`` (no vLLM, no network).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import random
import sys
import threading
import time
from typing import Any

import torch

from pd_mooncake import device_copy, kv_digest, staging

HOST = "127.0.0.1"
MLA_BLOCK = 64
DRAFT_SHAPE = (64, 8, 128)  # tokens per block, KV heads, head size


def layout(layers: int, blocks: int, device: str, zero: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)

    def make(*shape: int) -> torch.Tensor:
        t = torch.zeros(shape) if zero else torch.randn(shape, generator=g)
        return t.to(torch.bfloat16).to(device)

    caches = [make(blocks, MLA_BLOCK, 576) for _ in range(layers)]
    return [*caches, make(2, blocks, *DRAFT_SHAPE)]


def regions(caches: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(base address, block bytes) per region: each MLA layer, draft K, V."""
    *mla, draft = caches
    return [(t.data_ptr(), t[0].nbytes) for t in (*mla, draft[0], draft[1])]


def region_pages(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each region as (blocks, words) int32 rows, as the checksum reads it."""
    *mla, draft = caches
    return [t.reshape(t.shape[0], -1).view(torch.int32) for t in (*mla, *draft)]


def runs(src_ids: list[int], dst_ids: list[int]) -> list[list[int]]:
    """Upstream's block runs: consecutive on both sides."""
    out: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return out


def _preload_cuda_runtime() -> None:
    """Mooncake's CUDA build links libcudart; on a machine whose CUDA runtime
    is PyTorch's pip package (nvidia/cuda_runtime) it is not on the loader's
    path: load it by soname first."""
    import ctypes
    import glob

    for entry in sys.path:
        for lib in glob.glob(f"{entry}/nvidia/cuda_runtime/lib/libcudart.so.*"):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


def engine() -> Any:
    if torch.cuda.is_available():
        _preload_cuda_runtime()
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    if e.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine did not initialize on TCP")
    return e


def staging_buffer(nbytes: int, home: str, kv_device: str) -> torch.Tensor:
    pinned = home == "cpu" and kv_device.startswith("cuda")
    return torch.zeros(nbytes, dtype=torch.uint8, device=home, pin_memory=pinned)


def fingerprint(caches: list[torch.Tensor], ids: list[int]) -> tuple[list, str]:
    """The checksum's digest per region and a hash of the blocks' bytes."""
    index = torch.tensor(ids, dtype=torch.long, device=caches[0].device)
    digests = [int(kv_digest.digest(p, index)) for p in region_pages(caches)]
    h = hashlib.blake2b(digest_size=16)
    for pages in region_pages(caches):
        h.update(pages[index].cpu().numpy().tobytes())
    return digests, h.hexdigest()


class Decode:
    """Decode's side (the spawned process): zeroed caches and a staging
    buffer registered with its engine, the scatter and the check."""

    def __init__(self, layers: int, blocks: int, device: str, home: str, nbytes: int):
        self.device = device
        self.caches = layout(layers, blocks, device, zero=True)
        self.buffer = staging_buffer(nbytes, home, device)
        self.engine = engine()
        for t in (*self.caches, self.buffer):
            if self.engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError(f"register_memory failed on {t.device}")
        self.kv = device_copy.Memory(self.caches)
        self.staged = device_copy.Memory([self.buffer])
        self.ordering = device_copy.Ordering(torch.device(device))

    def address(self) -> tuple[str, int, list]:
        session = f"{HOST}:{self.engine.get_rpc_port()}"
        return session, self.buffer.data_ptr(), regions(self.caches)

    def scatter(self, nonce: int, landed: list[int]) -> dict:
        """What StagingWorker._staging_scatter does, then the check."""
        start = time.perf_counter()
        at = self.buffer.data_ptr()
        with self.ordering.staged():
            magic, got, count = (int(w) for w in self.staged.read_words(at, 3))
            if magic != staging.MAGIC or got != nonce:
                raise ValueError("no record of this pull in the span")
            table = self.staged.read_words(at + 8 * staging.HEAD_WORDS, 2 * count)
            dsts, lengths = table[:count].tolist(), table[count:].tolist()
            data = at + staging.head_bytes(count)
            srcs = [data + o for o in staging.offsets(lengths)]
            device_copy.move(self.kv, dsts, self.staged, srcs, lengths)
        scatter_s = time.perf_counter() - start
        start = time.perf_counter()
        digests, hashed = fingerprint(self.caches, landed)
        return {
            "scatter_s": scatter_s,
            "digest_s": time.perf_counter() - start,
            "digests": digests,
            "hash": hashed,
        }


def _serve(conn: Any, args: tuple) -> None:
    try:
        obj = Decode(*args)
        conn.send((True, None))
        for name, call_args in iter(conn.recv, None):
            conn.send((True, getattr(obj, name)(*call_args)))
    except Exception as exc:  # reported to the parent, which fails
        conn.send((False, f"{type(exc).__name__}: {exc}"))


class Peer:
    def __init__(self, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, args), daemon=True)
        self.proc.start()
        child.close()
        self.call(None)

    def call(self, name: str | None, *args: Any) -> Any:
        if name is not None:
            self.conn.send((name, args))
        if not self.conn.poll(120):
            raise RuntimeError(f"decode did not answer {name} in 120 s")
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"decode: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class SyncCounter:
    """Counts torch.cuda.synchronize (device-wide waits) while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = torch.cuda.synchronize

    def __enter__(self) -> SyncCounter:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._real(*args, **kwargs)

        torch.cuda.synchronize = counted
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize = self._real


def busy_step(ms: float) -> None:
    """About ``ms`` of work on the current (forward) stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda._sleep(int(ms * 1e6))  # cycles, ~1 per ns: a kernel that waits
    a @ a


def run(opts: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and not opts.cpu
    device = "cuda" if cuda else "cpu"
    home = opts.staging
    if home == "auto":
        home = str(device_copy.staging_home("tcp", torch.device(device)))
    rng = random.Random(5)
    sent = rng.sample(range(opts.blocks), opts.request_blocks)
    landed = rng.sample(range(opts.blocks), opts.request_blocks)
    caches = layout(opts.layers, opts.blocks, device, zero=False)
    want_digests, want_hash = fingerprint(caches, sent)
    if opts.corrupt:  # negative control: a byte changed after the digest
        caches[0][sent[0], 0, 0] += 1
    blocks = runs(sent, landed)
    lengths = [n * block for _, block in regions(caches) for _, _, n in blocks]
    size = staging.record_bytes(lengths)
    nbytes = staging.aligned(size)

    decode = Peer(opts.layers, opts.blocks, device, home, nbytes)
    try:
        session, span, decode_regions = decode.call("address")
        srcs, dsts = [], []
        for (s_base, block), (d_base, _) in zip(
            regions(caches), decode_regions, strict=True
        ):
            for s, d, _ in blocks:
                srcs.append(s_base + s * block)
                dsts.append(d_base + d * block)
        buffer = staging_buffer(nbytes, home, device)
        mine = engine()
        for t in (*caches, buffer):
            if mine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError(f"register_memory failed on {t.device}")
        log: list[str] = []
        streams = None if cuda else device_copy.HostStreams(log)
        ordering = device_copy.Ordering(torch.device(device), streams)
        kv, staged = device_copy.Memory(caches), device_copy.Memory([buffer])
        nonce = 0x1234_5678
        at = buffer.data_ptr()
        result: dict[str, Any] = {}

        def gather() -> None:  # the sender thread's part
            start = time.perf_counter()
            head = staging.header(nonce, dsts, lengths)
            with ordering.staged():
                staged.write_words(at, head)
                data = at + head.nbytes
                offsets = [data + o for o in staging.offsets(lengths)]
                result["copies"] = device_copy.move(staged, offsets, kv, srcs, lengths)
            result["gather_s"] = time.perf_counter() - start
            # The copy it replaced, for comparison: one per block run (the
            # same bytes to the same places; then the indexed gather again,
            # so what is sent is the indexed copy's).
            start = time.perf_counter()
            with ordering.staged():
                for d, s, n in zip(offsets, srcs, lengths, strict=True):
                    staged.view(d, n).copy_(kv.view(s, n), non_blocking=True)
            result["per_run_s"] = time.perf_counter() - start
            with ordering.staged():
                device_copy.move(staged, offsets, kv, srcs, lengths)

        with SyncCounter() as syncs:
            step_running = None
            if cuda:
                forward = torch.cuda.Stream()
                forward.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(forward):
                    ordering.mark_kv_ready()  # bind_connector_metadata
                    busy_step(opts.busy_ms)  # the step's forward, in flight
                    step_running = torch.cuda.Event()
                    step_running.record(forward)
            else:
                ordering.mark_kv_ready()
            sender = threading.Thread(target=gather)
            sender.start()
            sender.join()
            step_still_running = step_running is not None and not step_running.query()
            start = time.perf_counter()
            src, dst, chunk_lengths = staging.chunks(at, span, size)
            if mine.batch_transfer_sync_write(session, src, dst, chunk_lengths) != 0:
                raise RuntimeError("Mooncake write failed")
            write_s = time.perf_counter() - start
            got = decode.call("scatter", nonce, landed)
        waited = syncs.calls > 0 or any("all of forward" in line for line in log)
        if cuda:
            forward_note = (
                "no: the gather returned while the forward step ran"
                if step_still_running and not waited
                else "inconclusive: the step ended first (raise --busy-ms)"
                if not waited
                else "YES"
            )
        else:
            forward_note = "YES" if waited else "no (stand-ins: no device-wide wait)"
        return {
            "device": device,
            "staging": home + (" (pinned)" if buffer.is_pinned() else ""),
            "layers": opts.layers,
            "blocks": opts.request_blocks,
            "descriptors": len(lengths),
            "indexed_copies": result["copies"],
            "bytes": sum(lengths),
            "record_bytes": size,
            "write_descriptors": len(src),
            "per_run_gather_ms": 1e3 * result["per_run_s"],
            "gather_ms": 1e3 * result["gather_s"],
            "write_ms": 1e3 * write_s,
            "scatter_ms": 1e3 * got["scatter_s"],
            "digest_ms": 1e3 * got["digest_s"],
            "digests_match": got["digests"] == want_digests,
            "bytes_match": got["hash"] == want_hash,
            "device_wide_syncs": syncs.calls,
            "forward_waited": forward_note,
            "mooncake": sys.modules["mooncake.engine"].__file__,
        }
    finally:
        decode.close()


def report(r: dict) -> str:
    ok = r["digests_match"] and r["bytes_match"]
    return "\n".join(
        [
            f"gpu-datapath-check on {r['device']}, staging buffer {r['staging']}: "
            f"bf16 FlashMLA x{r['layers']} (block 64) + FlashAttention draft, "
            f"{r['blocks']} fragmented blocks = {r['descriptors']} block runs",
            f"bytes verified: {r['bytes'] if ok else 0} of {r['bytes']} "
            f"(checksum digests {'match' if r['digests_match'] else 'DIFFER'}, "
            f"landed bytes {'identical' if r['bytes_match'] else 'DIFFER'})",
            f"gather: {r['gather_ms']:.1f} ms ({r['indexed_copies']} indexed copies;"
            f" one copy per block run: {r['per_run_gather_ms']:.1f} ms)"
            f"  write: {r['write_ms']:.1f} ms ({r['write_descriptors']} descriptors, "
            f"TCP loopback)  scatter: {r['scatter_ms']:.1f} ms"
            f"  digest: {r['digest_ms']:.1f} ms",
            f"forward stream waited on: {r['forward_waited']} "
            f"(torch.cuda.synchronize calls: {r['device_wide_syncs']})",
            f"mooncake engine: {r['mooncake']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU tensors even on a GPU")
    p.add_argument("--layers", type=int, default=None, help="MLA layers")
    p.add_argument("--blocks", type=int, default=256, help="blocks per cache")
    p.add_argument("--request-blocks", type=int, default=63, help="~4000 tokens")
    p.add_argument(
        "--staging",
        default="auto",
        help="where the staging buffer lives: auto (the plugin's choice for "
        "TCP), cpu, cuda; on a GPU auto runs both homes",
    )
    p.add_argument("--busy-ms", type=float, default=300.0)
    p.add_argument("--corrupt", action="store_true", help="negative control")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not opts.cpu
    if opts.layers is None:
        opts.layers = 61 if cuda else 4
    homes = ["cpu", "cuda"] if cuda and opts.staging == "auto" else [opts.staging]
    results = []
    for home in homes:
        opts.staging = home
        results.append(run(opts))
    for r in results:
        print(json.dumps(r) if opts.json else report(r))
    bad = [
        r
        for r in results
        if not (r["digests_match"] and r["bytes_match"])
        or r["forward_waited"].startswith("YES")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
