"""Process and port helpers shared by the benchmark drivers
(benches/vs-nginx/run.py, benches/grpc/run.py, benches/smtp/run.py):
loopback ports, waiting for a listener, starting and ending child processes
by PID, and the CPU a process tree used (perf stat and /proc)."""
import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

# Every process start() began; the driver ends what is left with stop().
started = []


def workdir(prefix):
    """A fresh directory under /tmp for one run's configs and logs, removed
    when the driver exits (however it exits)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


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


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


def cpu_ticks(pids):
    """(user, system) clock ticks of these processes (threads included)."""
    u = s = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            u += int(fields[11])
            s += int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return u, s


TICK = os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """`perf stat` task-clock and context switches of `pids` for `seconds`,
    and their user and system time from /proc over the same span:
    `m = CpuMeter(pids, seconds, path)`, run the load, then
    `m.per(requests)`."""

    def __init__(self, pids, seconds, path):
        self.pids, self.seconds, self.path = pids, seconds, path
        self.perf = start(["perf", "stat", "-e", "task-clock,context-switches", "-x", ",",
                           "-o", path, "-p", ",".join(map(str, pids)), "--", "sleep", str(seconds)])
        self.ticks = cpu_ticks(pids)

    def per(self, requests):
        u1, s1 = cpu_ticks(self.pids)
        self.perf.wait(timeout=self.seconds + 30)
        started.remove(self.perf)
        stats = {}
        for line in open(self.path):
            parts = line.strip().split(",")
            if len(parts) > 2 and parts[0] and parts[0][0].isdigit():
                stats[parts[2]] = float(parts[0])
        n = max(requests, 1)
        res = {"task_clock_ms": stats.get("task-clock"),
               "context_switches": stats.get("context-switches")}
        if res["task_clock_ms"] is not None:
            res["cpu_us_per_request"] = res["task_clock_ms"] * 1000 / n
        res["user_us_per_request"] = (u1 - self.ticks[0]) / TICK * 1e6 / n
        res["sys_us_per_request"] = (s1 - self.ticks[1]) / TICK * 1e6 / n
        res["context_switches_per_request"] = (res["context_switches"] or 0) / n
        return res


def rss_kib(pids, field="VmRSS"):
    """Resident memory of `pids` in KiB, summed: all of it (`VmRSS`), or one
    part of it (`RssAnon`: heap and stacks; `RssFile`: the binary's and
    libraries' pages)."""
    total = 0
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def nginx_conf(workers, work, http):
    """A whole nginx.conf for a bench: `workers` worker processes, pid, log
    and temp files under `work`, no access log, keep-alive without a request
    limit, and `http` (the http block's own directives: zones, upstreams,
    servers) inside the http block."""
    tmp = os.path.join(work, "tmp")
    os.makedirs(tmp, exist_ok=True)
    return f"""worker_processes {workers};
worker_rlimit_nofile 200000;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log error;
daemon off;
events {{ worker_connections 60000; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
{http}}}
"""
