"""Serve mongoeco's MongoDB wire protocol on 127.0.0.1 (its memory engine) until SIGTERM.

Run with the interpreter of the venv scripts/mongo-server builds: mongoeco needs Python >= 3.13.
"""

import asyncio
import signal
import sys

from mongoeco.wire import AsyncMongoEcoProxyServer


async def main(port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncMongoEcoProxyServer(engine=None, host="127.0.0.1", port=port) as server:
        print(f"mongoeco wire server on {server.address}", flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
