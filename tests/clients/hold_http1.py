"""Hold N HTTP/1.1 requests open against HOST:PORT, one connection each,
all for client key "k"; print "sent" when all are written, then wait for
stdin to close and close them all. Bounded: N connections, each retried at
most 50 times.

    python3 hold_http1.py HOST PORT N
"""
import asyncio
import sys

host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


async def main():
    conns = []
    for i in range(n):
        for _ in range(50):
            try:
                r, w = await asyncio.open_connection(host, port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        else:
            sys.exit(f"cannot connect ({i} open)")
        w.write(b"GET /hold HTTP/1.1\r\nHost: t\r\nX-Client: k\r\n\r\n")
        conns.append((r, w))
        if i % 1000 == 999:
            await asyncio.sleep(0)
    print("sent", flush=True)
    await asyncio.get_event_loop().run_in_executor(None, sys.stdin.read)
    for _, w in conns:
        w.close()
    print("closed", flush=True)


asyncio.run(main())
