"""Decode's side of the late-write tests: two registered KV blocks in a
process of its own, behind a real Mooncake TransferEngine on 127.0.0.1. On
request it reuses block 0 for another request (writes the canary) or reports
both blocks' bytes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from typing import Any

import torch
from deadlines import SPAWN_DEADLINE_S

# Not conftest's RecordingEngine: the child would import vLLM with it (tens
# of seconds on the shared cores), and it needs only an engine.
from bench.loopback import tcp_engine

BLOCK = 1 << 16
DEADLINE_S = SPAWN_DEADLINE_S


def decode_process(to_test: Any, from_test: Any) -> None:
    """Decode: two registered blocks; on request, reuse block 0 for another
    request (write the canary), zero both, or report both blocks' bytes."""
    engine = tcp_engine()
    blocks = torch.zeros(2 * BLOCK, dtype=torch.uint8)
    engine.batch_register_memory([blocks.data_ptr()], [blocks.numel()])
    to_test.put((engine.get_rpc_port(), blocks.data_ptr(), os.getpid()))
    while True:
        command = from_test.get(timeout=DEADLINE_S)
        if command == "reuse":
            blocks[:BLOCK] = CANARY
            to_test.put("reused")
        elif command == "zero":
            blocks.zero_()
            to_test.put("zeroed")
        elif command == "read":
            to_test.put(blocks.numpy().tobytes())
        else:
            return


CANARY = 0xC5
SENT = 0x11


class Decode:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.replies, self.commands = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=decode_process, args=(self.replies, self.commands), daemon=True
        )
        self.proc.start()
        port, self.base, self.pid = self.replies.get(timeout=DEADLINE_S)
        self.session = f"127.0.0.1:{port}"

    def ask(self, command: str) -> Any:
        self.commands.put(command)
        return self.replies.get(timeout=DEADLINE_S)

    def close(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.commands.put("quit")
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
