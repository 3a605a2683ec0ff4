"""A mail-sending application for sluice's relay tests: Python's smtplib,
one connection per message, all started together.

Each connection says EHLO (and STARTTLS, AUTH when asked), then waits at a
barrier, so that every MAIL FROM is sent at the same moment. Prints one
JSON line per message: {"i", "mail": [code, text], "data": [code, text] or
null, "error": text or null, "done": monotonic ns}.
"""
import argparse
import json
import smtplib
import ssl
import threading
import time


def one(i, a, barrier, out, lock):
    result = {"i": i, "mail": None, "data": None, "error": None}
    try:
        with smtplib.SMTP(a.host, a.port, timeout=a.timeout) as c:
            c.ehlo("app.test")
            if a.starttls:
                c.starttls(context=ssl.create_default_context(cafile=a.ca))
                c.ehlo("app.test")
            if a.auth:
                user, password = a.auth.split(":", 1)
                if a.login:
                    c.user, c.password = user, password
                    c.auth("LOGIN", c.auth_login, initial_response_ok=False)
                else:
                    c.login(user, password)
            barrier.wait()
            sender = a.sender.replace("{i}", str(i))
            code, text = c.mail(sender, [f"SIZE={a.size + 200}"])
            result["mail"] = [code, text.decode()]
            if code == 250:
                for r in a.to:
                    c.rcpt(r)
                body = (f"From: {sender}\r\nTo: {', '.join(a.to)}\r\n"
                        f"Subject: {a.subject} {i}\r\n\r\n"
                        + ".starts with a dot\r\n" + "x" * a.size + "\r\n")
                code, text = c.data(body.encode())
                result["data"] = [code, text.decode()]
            c.quit()
    except smtplib.SMTPException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        code = getattr(e, "smtp_code", None)
        if code is not None:
            result["error_code"] = code
    except (OSError, threading.BrokenBarrierError) as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["done"] = time.monotonic_ns()
    with lock:
        out.append(result)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--sender", default="app{i}@example.com")
    p.add_argument("--to", nargs="+", default=["user@example.org"])
    p.add_argument("--subject", default="message")
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--starttls", action="store_true")
    p.add_argument("--ca")
    p.add_argument("--auth")
    p.add_argument("--login", action="store_true", help="AUTH LOGIN, no initial response")
    p.add_argument("--timeout", type=float, default=60)
    a = p.parse_args()
    barrier = threading.Barrier(a.count, timeout=a.timeout)
    out, lock = [], threading.Lock()
    threads = [threading.Thread(target=one, args=(i, a, barrier, out, lock))
               for i in range(a.count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in sorted(out, key=lambda r: r["i"]):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
