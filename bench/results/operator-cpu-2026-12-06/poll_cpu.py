"""CPU per poll of the operator's shim client: the health poll against /metrics + /readyz.

    python bench/operator_standin_shim.py --control-port 18399 &    # the stand-in, on SHIM_PORT
    python bench/results/operator-cpu-2026-12-06/poll_cpu.py poll 200 20
    python bench/results/operator-cpu-2026-12-06/poll_cpu.py old 200 20

200 pods (stand-in addresses in 127.16.0.0/16), each polled 20 times over its kept-alive connection,
all pods at once per round, on uvloop as the operator runs; CPU is this process's own (user + system,
the loopback's kernel work included), not wall time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "engine")]

import aiohttp  # noqa: E402
import uvloop  # noqa: E402
from flashmodel_operator.shim_client import ShimClient, ShimConnection  # noqa: E402


async def main(mode: str, pods: int, rounds: int) -> None:
    async with aiohttp.ClientSession() as session:
        connections = [ShimConnection(f"127.16.{i // 250}.{i % 250 + 1}", 8081) for i in range(pods)]

        async def one(connection: ShimConnection) -> None:
            client = ShimClient(session, connection.host, connection=connection)
            if mode == "poll":
                reading, ready = await client.poll(7)
            else:
                reading, ready = await client.metrics(), await client.ready(7)
            assert reading is not None and ready

        await asyncio.gather(*(one(c) for c in connections))  # connections opened, not measured
        cpu0, wall0 = time.process_time(), time.monotonic()
        for _ in range(rounds):
            await asyncio.gather(*(one(c) for c in connections))
        cpu = time.process_time() - cpu0
        polls = pods * rounds
        print(
            json.dumps(
                {
                    "mode": mode,
                    "polls": polls,
                    "cpu_ms_per_poll": round(1000 * cpu / polls, 3),
                    "wall_s": round(time.monotonic() - wall0, 1),
                }
            )
        )


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
