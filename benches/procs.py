"""Process and port helpers shared by the benchmark drivers
(benches/vs-nginx/run.py, benches/smtp/run.py): loopback ports, waiting for
a listener, and starting and ending child processes by PID."""
import signal
import socket
import subprocess
import time

# Every process start() began; the driver ends what is left with stop().
started = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def start(args, **kw):
    p = subprocess.Popen(args, **kw)
    started.append(p)
    return p


def stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
