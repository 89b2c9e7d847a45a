"""How long the tests wait for a spawned peer: a bound on a hang, never a
speed. A peer imports torch (and vLLM, where it builds a worker) before it
answers, which took over 60 s on 2 cores loaded by other test runs. Its own
module, so a spawned child that imports it imports nothing else."""

SPAWN_DEADLINE_S = 300.0
