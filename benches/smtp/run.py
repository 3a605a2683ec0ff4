#!/usr/bin/env python3
"""SMTP relay pacing and throughput, side by side with Postfix, in one run
on this machine, loopback only (driven by benches/smtp/run.sh, which builds
what it needs).

  1. floor: the C spinner's lateness to 1 ms deadlines (this VM's own
     scheduling floor), measured right before the pacing scenarios.
  2. precision: smtp-source (Postfix's load generator) hands N messages over
     S parallel sessions to sluice at r = 1/s, 10/s and 100/s; the upstream
     (aiosmtpd) stamps each end of data; |gap - 1/r| p50/p99 at the upstream.
  3. Postfix's own pacing: a private Postfix instance with
     default_destination_rate_delay = 1s (its smallest: whole seconds)
     relays the same kind of burst to the same upstream.
  4. throughput with pacing off: smtp-source -> sluice -> smtp-sink, messages
     per second end to end (each message answered only after the sink
     accepted it), against smtp-source -> smtp-sink directly.
  5. the README's relayhost recipe: a burst injected into Postfix, relayed
     through sluice (capacity below Postfix's concurrency, so some messages
     get 451 and Postfix retries them); every message must reach the
     upstream exactly once, paced.

Postfix runs as a private instance (own config and queue directory under a
temp dir, its smtpd on an ephemeral loopback port), started and stopped by
this script; it needs root (Postfix's master does). Prints one JSON line per
result and a markdown table. Every process it starts is ended by PID or by
`postfix stop` on its own instance; every load is bounded in count and time.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benches"))
from procs import free_port, start, started, stop, wait_port, workdir  # noqa: E402
SLUICE, FLOOR, OUT = sys.argv[1:4]
WORK = workdir("sluice-smtp-bench.")
UPSTREAM_PY = os.path.join(ROOT, "tests", "clients", "smtp_upstream.py")
results = []


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def emit(r):
    results.append(r)
    print(json.dumps(r), flush=True)


class Upstream:
    """aiosmtpd (tests/clients/smtp_upstream.py): one JSON line per message."""

    def __init__(self):
        self.p = start([sys.executable, UPSTREAM_PY], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
        first = self.p.stdout.readline().split()
        self.port = int(first[1])
        self.messages = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            m = json.loads(line)
            with self.lock:
                self.messages.append((m["t"], tuple(m["rcpts"])))

    def wait_for(self, n, timeout):
        end = time.time() + timeout
        while time.time() < end:
            with self.lock:
                if len(self.messages) >= n:
                    break
            time.sleep(0.05)
        time.sleep(0.5)
        with self.lock:
            return list(self.messages)

    def clear(self):
        with self.lock:
            self.messages.clear()


def sluice(upstream_port, rate, capacity, max_connections=4):
    port = free_port()
    cfg = os.path.join(WORK, f"sluice-{port}.toml")
    with open(cfg, "w") as f:
        f.write(f"""
[[smtp_upstream]]
name = "up"
url = "smtp://127.0.0.1:{upstream_port}"
tls = "none"
max_connections = {max_connections}

[[smtp]]
name = "mail"
listen = ["127.0.0.1:{port}"]
upstream = "up"
key = "global"
rate = "{rate}"
capacity = {capacity}
max_wait = "5m"
hostname = "sluice.test"
""")
    p = start([SLUICE, "run", "--config", cfg, "--log-level", "warn"])
    wait_port(port)
    return p, port


def smtp_source(port, messages, sessions, keep=False, numbered=False, timeout=300):
    args = ["smtp-source", "-s", str(sessions), "-m", str(messages), "-l", "1000",
            "-f", "app@app.test", "-t", "user@dest.test", "-M", "app.test"]
    if keep:
        args.append("-d")
    if numbered:
        args.append("-N")
    args.append(f"127.0.0.1:{port}")
    t0 = time.monotonic()
    subprocess.run(args, check=True, timeout=timeout, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def gaps_of(messages):
    ts = sorted(t for t, _ in messages)
    return [(b - a) / 1e9 for a, b in zip(ts, ts[1:])]


def precision(name, messages, interval, floor_p99):
    gaps = gaps_of(messages)
    dev = [abs(g - interval) * 1e6 for g in gaps]
    emit({
        "scenario": name, "messages": len(messages), "interval_ms": interval * 1e3,
        "mean_gap_ms": round(sum(gaps) / len(gaps) * 1e3, 3),
        "dev_p50_us": round(pct(dev, 0.5)), "dev_p99_us": round(pct(dev, 0.99)),
        "dev_max_us": round(max(dev)), "floor_p99_us": floor_p99,
    })


def floor():
    out = subprocess.run([FLOOR, "3000", "1000"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)


class Postfix:
    """A private Postfix instance: its own config and queue under WORK."""

    def __init__(self, relay_port, extra):
        self.dir = os.path.join(WORK, "postfix")
        etc = os.path.join(self.dir, "etc")
        os.makedirs(etc, exist_ok=True)
        self.port = free_port()
        shutil.copy("/etc/postfix/main.cf", etc)
        with open("/etc/postfix/master.cf") as f:
            master = []
            for line in f:
                cols = line.split()
                if cols and not line[0].isspace() and not line.startswith("#") \
                        and len(cols) >= 8:
                    if cols[0] == "smtp" and cols[1] == "inet":
                        cols[0] = f"127.0.0.1:{self.port}"
                    cols[4] = "n"  # no chroot: the private queue is not set up for one
                    line = " ".join(cols) + "\n"
                master.append(line)
        with open(os.path.join(etc, "master.cf"), "w") as f:
            f.writelines(master)
        settings = {
            "queue_directory": os.path.join(self.dir, "spool"),
            "data_directory": os.path.join(self.dir, "data"),
            "inet_interfaces": "127.0.0.1", "inet_protocols": "ipv4",
            "myhostname": "postfix.test", "mydestination": "",
            "relayhost": f"[127.0.0.1]:{relay_port}",
            "smtp_tls_security_level": "none", "smtpd_tls_security_level": "none",
            "maillog_file": os.path.join(self.dir, "maillog"),
            "maillog_file_prefixes": WORK,
            "mynetworks": "127.0.0.0/8", "alias_maps": "", "alias_database": "",
            "smtp_data_done_timeout": "600s",
            "default_transport": "smtp", "relay_transport": "smtp",
        }
        settings.update(extra)
        subprocess.run(["postconf", "-c", etc, "-e"] +
                       [f"{k}={v}" for k, v in settings.items()], check=True)
        self.etc = etc
        os.makedirs(settings["queue_directory"], exist_ok=True)
        os.makedirs(settings["data_directory"], exist_ok=True)
        shutil.chown(settings["data_directory"], "postfix")
        # Postfix commands accept a non-default config directory only when
        # the default main.cf lists it; main() restores the original.
        subprocess.run(["postconf", "-e", f"alternate_config_directories = {etc}"], check=True)
        subprocess.run(["postfix", "-c", etc, "check"], check=True)
        subprocess.run(["postfix", "-c", etc, "start"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def queue_empty(self):
        out = subprocess.run(["postqueue", "-c", self.etc, "-p"], capture_output=True,
                             text=True).stdout
        return "Mail queue is empty" in out

    def stop(self):
        subprocess.run(["postfix", "-c", self.etc, "stop"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    os.makedirs(OUT, exist_ok=True)
    os.chmod(WORK, 0o755)
    have_postfix = shutil.which("postfix") is not None and os.geteuid() == 0
    main_cf = None
    if have_postfix:
        with open("/etc/postfix/main.cf") as f:
            main_cf = f.read()
    up = Upstream()
    try:
        f = floor()
        emit({"scenario": "floor", **f})
        # 2. sluice's precision at 1/s, 10/s, 100/s.
        for rate, n, s in (("1/s", 11, 11), ("10/s", 101, 20), ("100/s", 501, 50)):
            per_s = float(rate.split("/")[0])
            p, port = sluice(up.port, rate, n)
            up.clear()
            smtp_source(port, n, s)
            msgs = up.wait_for(n, 30)
            stop(p)
            precision(f"sluice {rate}", msgs, 1 / per_s, f["p99_us"])
        # 3. Postfix's own rate delay (whole seconds only: 1/s at best).
        if have_postfix:
            pf = Postfix(up.port, {"default_destination_rate_delay": "1s"})
            try:
                up.clear()
                smtp_source(pf.port, 11, 11)
                msgs = up.wait_for(11, 60)
            finally:
                pf.stop()
            precision("postfix rate_delay=1s", msgs, 1.0, f["p99_us"])
        # 4. Throughput with pacing off (sink: smtp-sink).
        sink_port = free_port()
        sink_user = ["-u", "nobody"] if os.geteuid() == 0 else []
        sink = start(["smtp-sink", *sink_user, f"127.0.0.1:{sink_port}", "1000"],
                     stdout=subprocess.DEVNULL)
        wait_port(sink_port)
        n = 5000
        direct = smtp_source(sink_port, n, 32, keep=True)
        emit({"scenario": "throughput direct (smtp-source -> smtp-sink)",
              "messages": n, "seconds": round(direct, 2), "msgs_per_s": round(n / direct)})
        p, port = sluice(sink_port, "1000000/s", n, max_connections=32)
        cpu0 = cpu_of(p.pid)
        through = smtp_source(port, n, 32, keep=True)
        cpu = cpu_of(p.pid) - cpu0
        stop(p)
        emit({"scenario": "throughput through sluice, pacing off", "messages": n,
              "seconds": round(through, 2), "msgs_per_s": round(n / through),
              "sluice_cpu_us_per_msg": round(cpu / n * 1e6)})
        if have_postfix:
            pf = Postfix(sink_port, {})
            try:
                t0 = time.monotonic()
                smtp_source(pf.port, n, 32, keep=True)
                end = time.time() + 300
                while not pf.queue_empty() and time.time() < end:
                    time.sleep(0.1)
                took = time.monotonic() - t0
            finally:
                pf.stop()
            emit({"scenario": "throughput through postfix (no rate delay, queue on disk)",
                  "messages": n, "seconds": round(took, 2), "msgs_per_s": round(n / took)})
        stop(sink)
        # 5. The README recipe: Postfix relayhost -> sluice (5/s, capacity 8) -> upstream.
        if have_postfix:
            p, port = sluice(up.port, "5/s", 8)
            pf = Postfix(port, {"minimal_backoff_time": "2s", "maximal_backoff_time": "4s",
                                "queue_run_delay": "2s"})
            try:
                up.clear()
                n = 40
                smtp_source(pf.port, n, 20, numbered=True)
                msgs = up.wait_for(n, 120)
                end = time.time() + 60
                while not pf.queue_empty() and time.time() < end:
                    time.sleep(0.2)
                deferred = 0
                try:
                    with open(os.path.join(pf.dir, "maillog")) as log:
                        deferred = sum("status=deferred" in line for line in log)
                except OSError:
                    pass
            finally:
                pf.stop()
                stop(p)
            rcpts = [r for _, rs in msgs for r in rs]
            gaps = gaps_of(msgs)
            emit({"scenario": "postfix relayhost -> sluice 5/s, capacity 8",
                  "sent": n, "arrived": len(msgs), "unique": len(set(rcpts)),
                  "duplicates": len(rcpts) - len(set(rcpts)), "deferred_by_postfix": deferred,
                  "min_gap_ms": round(min(gaps) * 1e3, 1),
                  "mean_gap_ms": round(sum(gaps) / len(gaps) * 1e3, 1)})
    finally:
        for p in started:
            stop(p)
        if main_cf is not None:
            with open("/etc/postfix/main.cf", "w") as f:
                f.write(main_cf)
    with open(os.path.join(OUT, "results.jsonl"), "w") as out:
        for r in results:
            out.write(json.dumps(r) + "\n")


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
