"""A WebSocket upstream for sluice's Upgrade tests: a `websockets` (10.x,
legacy asyncio API) echo server on 127.0.0.1.

Prints `listening PORT` first, then per connection `open <monotonic ns>
<path>` when its handshake request arrives (before the 101 is sent) and
`closed <path>` when it ends. Echoes every message; the text `close-me`
makes the server close the connection with code 1000 instead.

--port P        0 (the default) picks a free port
--lifetime S    exit after S seconds at most (default 600)

Runs until stdin closes (or --lifetime passes, or it is killed).

    python3 ws_server.py --port 0
"""
import argparse
import asyncio
import sys
import threading
import time

import websockets


async def on_request(path, headers):
    print(f"open {time.monotonic_ns()} {path}", flush=True)
    return None  # go on with the handshake


async def echo(ws):
    try:
        async for msg in ws:
            if msg == "close-me":
                await ws.close(code=1000, reason="asked to")
                break
            await ws.send(msg)
    except websockets.ConnectionClosed:
        pass
    finally:
        print(f"closed {ws.path}", flush=True)


async def stdin_closed():
    # A daemon thread, so that a timeout does not wait for it at exit.
    loop, done = asyncio.get_running_loop(), asyncio.Event()

    def read():
        sys.stdin.read()
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:
            pass  # the loop is gone already

    threading.Thread(target=read, daemon=True).start()
    await done.wait()


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--lifetime", type=float, default=600)
    a = p.parse_args()
    async with websockets.serve(echo, "127.0.0.1", a.port, process_request=on_request,
                                close_timeout=2) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"listening {port}", flush=True)
        # Until the test closes stdin, bounded by --lifetime.
        try:
            await asyncio.wait_for(stdin_closed(), a.lifetime)
        except asyncio.TimeoutError:
            pass


if __name__ == "__main__":
    asyncio.run(main())
