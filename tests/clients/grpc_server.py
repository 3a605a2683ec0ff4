"""A gRPC upstream for sluice's HTTP/2 tests: grpcio with a generic
handler on raw bytes (no protobuf, no generated code), on 127.0.0.1.

Prints `listening PORT` first, then one line per Unary or Busy call as
it arrives: `call <monotonic ns> <request as utf-8>`.

Methods (service sluice.test.Echo):
  Unary         echoes the request; trailing metadata `x-echo-trailer: yes`
  ServerStream  request is an ASCII integer N; streams msg-0..msg-{N-1},
                100 ms apart
  Slow          sleeps 2 s, then echoes
  Busy          refuses as an overloaded server does: RESOURCE_EXHAUSTED,
                trailing metadata `grpc-retry-pushback-ms: 1500` (A6)

--port P             0 (the default) picks a free port
--tls-cert F --tls-key F   serve TLS (h2 via ALPN) instead of h2c
--max-streams N      advertise SETTINGS_MAX_CONCURRENT_STREAMS = N
--lifetime S         exit after S seconds at most (default 600)

Runs until stdin closes (or --lifetime passes, or it is killed).

    python3 grpc_server.py --port 0
"""
import argparse
import sys
import threading
import time
from concurrent import futures

import grpc

SERVICE = "sluice.test.Echo"
out = threading.Lock()


def say(line):
    with out:
        print(line, flush=True)


def unary(request, context):
    say(f"call {time.monotonic_ns()} {request.decode('utf-8', 'replace')}")
    context.set_trailing_metadata((("x-echo-trailer", "yes"),))
    return request


def server_stream(request, context):
    try:
        n = int(request.decode("ascii").strip() or "0")
    except ValueError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request must be an integer")
    for i in range(min(n, 10000)):
        if i:
            time.sleep(0.1)
        if not context.is_active():
            return
        yield f"msg-{i}".encode()


def slow(request, context):
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and context.is_active():
        time.sleep(0.02)
    return request


def busy(request, context):
    say(f"call {time.monotonic_ns()} {request.decode('utf-8', 'replace')}")
    context.set_trailing_metadata((("grpc-retry-pushback-ms", "1500"),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--max-streams", type=int)
    p.add_argument("--lifetime", type=float, default=600)
    a = p.parse_args()
    # With no (de)serializers grpcio hands the handlers raw bytes.
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "Slow": grpc.unary_unary_rpc_method_handler(slow),
        "Busy": grpc.unary_unary_rpc_method_handler(busy),
    })
    options = []
    if a.max_streams is not None:
        options.append(("grpc.max_concurrent_streams", a.max_streams))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=128),
                         handlers=(handler,), options=options)
    addr = f"127.0.0.1:{a.port}"
    if a.tls_cert:
        with open(a.tls_key, "rb") as k, open(a.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(addr, creds)
    else:
        port = server.add_insecure_port(addr)
    if not port:
        sys.exit(f"cannot bind {addr}")
    server.start()
    say(f"listening {port}")
    # Until the test closes stdin, bounded by --lifetime.
    stdin_closed = threading.Thread(target=sys.stdin.read, daemon=True)
    stdin_closed.start()
    stdin_closed.join(a.lifetime)
    server.stop(grace=0.5).wait(2)


if __name__ == "__main__":
    main()
