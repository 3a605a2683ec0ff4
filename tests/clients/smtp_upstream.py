"""An SMTP upstream for sluice's relay tests: aiosmtpd (a real SMTP
server), on 127.0.0.1 with an ephemeral port.

Prints `PORT <n>` first, then one JSON line per message taken:
{"t": monotonic ns at its end of data, "qid", "from", "rcpts", "size",
"subject", "received": [Received headers]}.

--tls CERT KEY   offer STARTTLS and require it
--auth USER:PASS require AUTH (PLAIN/LOGIN)
--mode-file F    read before each MAIL: "ok", "throttle-once" (one
                 `454 Throttling failure` then ok), "451" (always),
                 "drop-at-dot" (close at the end of data, no reply),
                 "354-at-dot" (takes the message, answers its end of
                 data 354: out of step), "421-at-dot" (takes the
                 message, answers its end of data 421),
                 "mixed-at-dot" (takes the message, answers its end of
                 data with a 250 line over a 550 one), "long-at-dot"
                 (takes the message, answers its end of data with a
                 250 line of 5,000 bytes),
                 "421-close", "slow-reply" (takes the message, answers
                 its end of data 1 s later), "slower-reply" (3 s later),
                 "550-606" (MAIL refused `550 5.7.606`), "550-close"
                 (MAIL refused `550 5.7.1`, then the connection closed
                 without answering the rest of a pipelined group),
                 "no-ehlo" (EHLO answered 502: HELO only), "plain-ehlo"
                 (EHLO offers neither 8BITMIME nor SMTPUTF8), "size-1000"
                 (EHLO offers SIZE 1000)
"""
import argparse
import asyncio
import itertools
import json
import ssl
import sys
import time

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword


class Upstream:
    def __init__(self, mode_file):
        self.mode_file = mode_file
        self.ids = itertools.count(1)
        self.throttled = False

    def mode(self):
        if not self.mode_file:
            return "ok"
        try:
            with open(self.mode_file) as f:
                return f.read().strip() or "ok"
        except OSError:
            return "ok"

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        if self.mode() == "no-ehlo":
            return ["502 5.5.2 Error: command not recognized"]
        if self.mode() == "plain-ehlo":
            responses = [r for r in responses
                         if r[4:] not in ("8BITMIME", "SMTPUTF8")]
        if self.mode() == "size-1000":
            responses = ["250-SIZE 1000" if r[4:].startswith("SIZE") else r
                         for r in responses]
        session.host_name = hostname
        responses.insert(1, "250-PIPELINING")
        responses.insert(1, "250-ENHANCEDSTATUSCODES")
        return responses

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        mode = self.mode()
        if mode == "throttle-once" and not self.throttled:
            self.throttled = True
            return "454 4.7.0 Throttling failure: Maximum sending rate exceeded."
        if mode == "451":
            return "451 4.3.0 Local error in processing"
        if mode == "550-606":
            return "550 5.7.606 Access denied, banned sending IP"
        if mode == "550-close":
            # Written and closed at once: nothing after it (the rest of
            # the group's replies, or this return's) reaches the client.
            server.transport.write(b"550 5.7.1 Sender blocked\r\n")
            server.transport.close()
            return "550 5.7.1 Sender blocked"
        if mode == "421-close":
            asyncio.get_running_loop().call_soon(server.transport.close)
            return "421 4.3.2 Service shutting down"
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Ok"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        if address.startswith("unknown@"):
            return "550 5.1.1 No such user here"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server, session, envelope):
        t = time.monotonic_ns()
        if self.mode() == "drop-at-dot":
            server.transport.abort()
            return "451 unreachable"
        qid = f"Q{next(self.ids):08X}"
        content = envelope.original_content or b""
        head = content.split(b"\r\n\r\n", 1)[0].decode("utf-8", "replace")
        unfolded = head.replace("\r\n\t", " ").replace("\r\n ", " ")
        subject = ""
        received = []
        for line in unfolded.split("\r\n"):
            if line.lower().startswith("subject:"):
                subject = line.split(":", 1)[1].strip()
            if line.lower().startswith("received:"):
                received.append(line)
        print(json.dumps({
            "t": t, "qid": qid, "from": envelope.mail_from,
            "rcpts": list(envelope.rcpt_tos), "size": len(content),
            "subject": subject, "received": received,
            "body": content.decode("utf-8", "replace"),
        }), flush=True)
        if self.mode() == "354-at-dot":
            return "354 out of step"
        if self.mode() == "421-at-dot":
            return "421 4.3.0 Shutting down"
        if self.mode() == "mixed-at-dot":
            return "250-2.0.0 Ok\r\n550 5.7.1 Rejected"
        if self.mode() == "long-at-dot":
            return f"250 2.0.0 Ok: queued as {qid} " + "x" * 5000
        if self.mode() == "slow-reply":
            await asyncio.sleep(1)
        elif self.mode() == "slower-reply":
            await asyncio.sleep(3)
        return f"250 2.0.0 Ok: queued as {qid}"


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tls", nargs=2)
    p.add_argument("--auth")
    p.add_argument("--mode-file")
    a = p.parse_args()
    handler = Upstream(a.mode_file)
    kwargs = dict(hostname="upstream.test", data_size_limit=32 * 1024 * 1024,
                  enable_SMTPUTF8=True, timeout=60)
    if a.tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(a.tls[0], a.tls[1])
        kwargs.update(tls_context=ctx, require_starttls=True)
    if a.auth:
        user, password = a.auth.encode().split(b":", 1)

        def authenticator(server, session, envelope, mechanism, data):
            ok = isinstance(data, LoginPassword) and data.login == user \
                and data.password == password
            # handled=False: aiosmtpd then answers 535 itself.
            return AuthResult(success=ok, handled=False)

        kwargs.update(authenticator=authenticator, auth_required=True,
                      auth_require_tls=bool(a.tls))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SMTP(handler, **kwargs), "127.0.0.1", 0)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    # Until the test closes stdin (or kills us).
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
