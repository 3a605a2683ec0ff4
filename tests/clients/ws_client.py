"""A WebSocket client for sluice's Upgrade tests: `websockets` (10.x,
legacy asyncio API). Opens N connections at once, each sends `hello-i`
as soon as it is open and waits for the echo.

Prints one JSON line per connection as it ends, then `done`:
  {"i", "opened": bool, "open_ms": from the common start to the end of
   the handshake, "echo_ms": from the send to the echo, "error": str|null}
With --server-close each also sends `close-me` after the echo and adds
  "server_closed": bool (the close came within 2 s), "close_code".

--url ws://HOST:PORT/path   --count N (default 1)
--hold S          keep each connection open S s after the echo, or until
                  the other side closes it (then adds "hold_cut": true)
--timeout S       bound on the handshake and on each wait (default 10);
                  a handshake that times out takes up to 2 s more to tear
                  down (websockets waits close_timeout for the TCP close).
A refused handshake reports e.g. "InvalidStatusCode: server rejected
WebSocket connection: HTTP 429" as its error.

    python3 ws_client.py --url ws://127.0.0.1:8080/chat --count 3
"""
import argparse
import asyncio
import json
import time

import websockets

# websockets imports lazily: resolve it now, not inside the timed part.
connect = websockets.connect


def ms(since):
    return round((time.monotonic() - since) * 1000, 3)


async def one(i, a, start):
    r = {"i": i, "opened": False, "open_ms": None, "echo_ms": None, "error": None}
    if a.server_close:
        r.update(server_closed=False, close_code=None)
    ws = None
    try:
        ws = await connect(a.url, open_timeout=a.timeout, close_timeout=2,
                            ping_interval=None)
        r["opened"], r["open_ms"] = True, ms(start)
        sent = time.monotonic()
        await ws.send(f"hello-{i}")
        echo = await asyncio.wait_for(ws.recv(), a.timeout)
        r["echo_ms"] = ms(sent)
        if echo != f"hello-{i}":
            r["error"] = f"echo was {echo!r}"
        if a.hold:
            # Held until the hold ends or the other side closes, whichever
            # comes first ("hold_cut": the close came first).
            try:
                await asyncio.wait_for(ws.wait_closed(), a.hold)
                r["hold_cut"] = True
            except asyncio.TimeoutError:
                r["hold_cut"] = False
        if a.server_close:
            await ws.send("close-me")
            try:
                await asyncio.wait_for(ws.wait_closed(), 2)
                r["server_closed"] = True
            except asyncio.TimeoutError:
                pass
            r["close_code"] = ws.close_code
    except Exception as e:  # reported, not raised: one line per connection
        r["error"] = f"{type(e).__name__}: {e}".rstrip(": ")
    finally:
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 5)
            except Exception:
                pass
    print(json.dumps(r), flush=True)


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--hold", type=float, default=0)
    p.add_argument("--timeout", type=float, default=10)
    p.add_argument("--server-close", action="store_true")
    a = p.parse_args()
    start = time.monotonic()
    await asyncio.gather(*(one(i, a, start) for i in range(a.count)))
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
