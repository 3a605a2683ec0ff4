"""A gRPC client for sluice's HTTP/2 tests: grpcio on raw bytes against
the methods of grpc_server.py (service sluice.test.Echo). One channel, so
all calls are streams on one HTTP/2 connection.

Modes:
  unary --count N [--deadline-ms D] [--method Unary|Slow|Busy]
      starts N calls at once, payload `call-i`; prints one JSON line per
      call as it ends: {"i", "code" ("OK", "RESOURCE_EXHAUSTED", ...),
      "details", "trailers" (trailing metadata, e.g.
      grpc-retry-pushback-ms), "elapsed_ms" (from the common start)};
      then `done`.
  stream --n N [--deadline-ms D]
      one ServerStream call; prints {"msg", "elapsed_ms"} per message,
      then {"code", "details", "trailers", "elapsed_ms"}, then `done`.

--target HOST:PORT; --tls-ca F for TLS (else h2c, prior knowledge);
--authority NAME sets :authority (and the TLS name to check).
--wait-go: connect first, print `ready`, and start the calls when a line
comes on stdin (the start-up and the connection out of the timing).
The deadline (default 10 s) bounds every call.

    python3 grpc_client.py --target 127.0.0.1:8080 unary --count 5
"""
import argparse
import json
import sys
import threading
import time

import grpc

SERVICE = "/sluice.test.Echo/"


def say(obj):
    print(obj if isinstance(obj, str) else json.dumps(obj), flush=True)


def metadata(md):
    # Values are str, or bytes for `-bin` keys.
    return {k: v.decode("latin-1") if isinstance(v, bytes) else v
            for k, v in (md or ())}


def channel(a):
    options = []
    if a.authority:
        options.append(("grpc.default_authority", a.authority))
    if a.tls_ca:
        with open(a.tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        if a.authority:
            options.append(("grpc.ssl_target_name_override", a.authority))
        return grpc.secure_channel(a.target, creds, options=options)
    return grpc.insecure_channel(a.target, options=options)


def unary(ch, a):
    call = ch.unary_unary(SERVICE + a.method)
    start = time.monotonic()
    ended = threading.Semaphore(0)
    lock = threading.Lock()

    def report(i, fut):
        ms = (time.monotonic() - start) * 1000
        with lock:
            say({"i": i, "code": fut.code().name, "details": fut.details(),
                 "trailers": metadata(fut.trailing_metadata()),
                 "elapsed_ms": round(ms, 3)})
        ended.release()

    calls = []
    for i in range(a.count):
        fut = call.future(f"call-{i}".encode(), timeout=a.deadline_ms / 1000)
        calls.append(fut)  # keep a reference until it ends
        fut.add_done_callback(lambda f, i=i: report(i, f))
    # Every call ends by its deadline; the margin covers the callbacks.
    until = start + a.deadline_ms / 1000 + 5
    for _ in range(a.count):
        if not ended.acquire(timeout=max(0.0, until - time.monotonic())):
            sys.exit("calls did not end in time")
    say("done")


def stream(ch, a):
    call = ch.unary_stream(SERVICE + "ServerStream")
    start = time.monotonic()
    it = call(str(a.n).encode(), timeout=a.deadline_ms / 1000)
    try:
        for msg in it:
            say({"msg": msg.decode("utf-8", "replace"),
                 "elapsed_ms": round((time.monotonic() - start) * 1000, 3)})
    except grpc.RpcError:
        pass  # the status is reported below
    say({"code": it.code().name, "details": it.details(),
         "trailers": metadata(it.trailing_metadata()),
         "elapsed_ms": round((time.monotonic() - start) * 1000, 3)})
    say("done")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--tls-ca")
    p.add_argument("--authority")
    p.add_argument("--wait-go", action="store_true")
    sub = p.add_subparsers(dest="mode", required=True)
    u = sub.add_parser("unary")
    u.add_argument("--count", type=int, default=1)
    u.add_argument("--deadline-ms", type=float, default=10000)
    u.add_argument("--method", default="Unary", choices=["Unary", "Slow", "Busy"])
    s = sub.add_parser("stream")
    s.add_argument("--n", type=int, default=3)
    s.add_argument("--deadline-ms", type=float, default=10000)
    a = p.parse_args()
    with channel(a) as ch:
        if a.wait_go:
            grpc.channel_ready_future(ch).result(timeout=10)
            say("ready")
            sys.stdin.readline()
        (unary if a.mode == "unary" else stream)(ch, a)


if __name__ == "__main__":
    main()
