//! HTTP/1.1 as sluice serves it itself (requests without a body) and as it
//! hands a connection to hyper (a body), seen byte for byte by a raw client
//! on one connection: framing, pipelining, `HEAD`, `Connection: close`,
//! bodies of unknown length, `Date`.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use support::{Downstream, Sluice};

fn config(upstream: SocketAddr) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[[upstream]]
name = "api"
url = "http://{upstream}"
request_timeout = "5s"

[[route]]
name = "default"
upstream = "api"
key = "header:X-Client"
rate = "1000/s"
capacity = 100
"#
    )
}

/// One response as read off the wire.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Lowercased names.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    BufReader::new(s)
}

fn send(conn: &mut BufReader<TcpStream>, bytes: &[u8]) {
    conn.get_mut().write_all(bytes).unwrap();
}

/// An upstream that answers each of `connections` connections with
/// `answer` (whatever was asked), then keeps it open for `hold`.
fn canned_upstream(answer: &'static [u8], connections: usize, hold: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for _ in 0..connections {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(answer);
            std::thread::sleep(hold);
        }
    });
    addr
}

/// Send `request` on a new connection and read until sluice closes it.
fn exchange(addr: SocketAddr, request: &[u8]) -> String {
    let c = &mut connect(addr);
    let t = Instant::now();
    send(c, request);
    let mut got = Vec::new();
    let read = c.read_to_end(&mut got);
    assert!(read.is_ok(), "still open after {:?}: {read:?}", t.elapsed());
    String::from_utf8_lossy(&got).into_owned()
}

/// A POST (hyper's client upstream) and a GET (sluice's own), each
/// closing its connection.
const BOTH_CLIENTS: [&[u8]; 2] = [
    b"POST /both HTTP/1.1\r\nHost: t\r\nX-Client: s\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
    b"GET /both HTTP/1.1\r\nHost: t\r\nX-Client: s\r\nconnection: close\r\n\r\n",
];

/// Read one response; `head` says it answers a `HEAD` (no body).
fn read_answer(conn: &mut BufReader<TcpStream>, head: bool) -> Answer {
    let mut line = String::new();
    conn.read_line(&mut line).unwrap();
    assert!(line.starts_with("HTTP/1.1 "), "status line {line:?}");
    let status = line[9..12].parse().unwrap();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        conn.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':').unwrap();
        headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut answer = Answer {
        status,
        headers,
        body: Vec::new(),
    };
    if head {
        return answer;
    }
    if let Some(n) = answer.header("content-length") {
        let mut body = vec![0; n.parse().unwrap()];
        conn.read_exact(&mut body).unwrap();
        answer.body = body;
    } else if answer.header("transfer-encoding") == Some("chunked") {
        loop {
            let mut size = String::new();
            conn.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim_end(), 16).unwrap();
            let mut chunk = vec![0; n + 2];
            conn.read_exact(&mut chunk).unwrap();
            assert_eq!(&chunk[n..], b"\r\n");
            if n == 0 {
                break;
            }
            answer.body.extend_from_slice(&chunk[..n]);
        }
    } else {
        conn.read_to_end(&mut answer.body).unwrap();
    }
    answer
}

/// Start sluice in front of `upstream` and run `client` on one raw
/// connection to it (blocking I/O, off the runtime).
async fn on_one_connection(
    upstream: SocketAddr,
    client: impl FnOnce(&mut BufReader<TcpStream>) + Send + 'static,
) {
    let sluice = Sluice::start(&config(upstream));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || client(&mut connect(addr)))
        .await
        .unwrap();
}

/// A downstream that answers every request with a chunked body (no
/// length): "hello world" in two chunks, or nothing to a `HEAD`.
fn chunked_downstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(16) {
            let Ok(conn) = conn else { return };
            std::thread::spawn(move || {
                let mut conn = BufReader::new(conn);
                loop {
                    let mut head = String::new();
                    let mut line = String::new();
                    while conn.read_line(&mut line).is_ok_and(|n| n > 0) {
                        head.push_str(&line);
                        if line == "\r\n" {
                            break;
                        }
                        line.clear();
                    }
                    if head.is_empty() {
                        return;
                    }
                    let answer: &[u8] = if head.starts_with("HEAD ") {
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    } else {
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
                    };
                    if conn.get_mut().write_all(answer).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Two requests in one write are answered in order on their connection;
/// a request with a body then goes on the same connection (hyper's from
/// there on), and so does a request after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_then_a_body_on_one_connection() {
    let ds = Downstream::start().await;
    on_one_connection(ds.addr, |c| {
        send(
            c,
            b"GET /one HTTP/1.1\r\nHost: t\r\nX-Client: p\r\n\r\nGET /two HTTP/1.1\r\nHost: t\r\nX-Client: p\r\n\r\n",
        );
        for _ in 0..2 {
            let a = read_answer(c, false);
            assert_eq!((a.status, a.body.as_slice()), (200, &b"ok"[..]), "{a:?}");
            assert!(a.header("date").is_some(), "{a:?}");
            assert_eq!(a.header("connection"), None, "{a:?}");
        }
        send(
            c,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: p\r\nContent-Length: 5\r\n\r\nhello",
        );
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"hello"[..]), "{a:?}");
        send(c, b"GET /three HTTP/1.1\r\nHost: t\r\nX-Client: p\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"ok"[..]), "{a:?}");
    })
    .await;
    let paths: Vec<String> = ds.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/one", "/two", "/echo", "/three"]);
}

/// A `GET` with a chunked body (a search API's query, say) reaches the
/// upstream with its body, sent on at once as when it is staged: hyper
/// sends a `GET` of unknown length as if it had none unless it is told
/// `chunked`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_chunked_body_reaches_the_upstream_whole() {
    let ds = Downstream::start().await;
    on_one_connection(ds.addr, |c| {
        send(
            c,
            b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Client: g\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        );
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"hello"[..]), "{a:?}");
        // And one without a body after it is still sent without one.
        send(c, b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Client: g\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b""[..]), "{a:?}");
    })
    .await;
    let seen = ds.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body_len, 5);
    assert_eq!(seen[1].headers.get("transfer-encoding"), None);
}

/// A request framed both by `Content-Length` and `Transfer-Encoding` is
/// read as chunked and its connection closed after the answer (RFC 9112
/// 6.1), so what a front proxy framing by the length would have sent as
/// the body's end, a second request, is never read; on a connection
/// sluice's own server handed over with that request and on one hyper
/// served already, with the two fields in either order. A transfer
/// coding besides `chunked` is 501 (the upstream would take coded bytes
/// for the content).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_framed_two_ways_ends_its_connection() {
    let ds = Downstream::start().await;
    let sluice = Sluice::start(&config(ds.addr));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let smuggling = [
            "POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: s\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: t\r\nX-Client: s\r\n\r\n",
            "POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: s\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: t\r\nX-Client: s\r\n\r\n",
        ];
        // Before each: nothing (sluice's server reads the head), or a
        // chunked request that gave the connection to hyper.
        let before = [
            "",
            "POST /first HTTP/1.1\r\nHost: t\r\nX-Client: s\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        ];
        for request in smuggling {
            for first in before {
                let c = &mut connect(addr);
                if !first.is_empty() {
                    send(c, first.as_bytes());
                    let a = read_answer(c, false);
                    assert_eq!(a.status, 200, "{a:?}");
                }
                send(c, request.as_bytes());
                let a = read_answer(c, false);
                assert_eq!(a.status, 200, "{a:?}");
                let mut rest = Vec::new();
                c.read_to_end(&mut rest).unwrap();
                assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
            }
        }
        let c = &mut connect(addr);
        send(
            c,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: s\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        );
        assert_eq!(read_answer(c, false).status, 501);
    })
    .await
    .unwrap();
    let seen = ds.seen();
    assert!(seen.iter().all(|s| s.path != "/smuggled"), "{seen:?}");
    assert_eq!(seen.iter().filter(|s| s.path == "/echo").count(), 4);
}

/// A chunked body with a trailer reaches the upstream with its trailer
/// when it is staged (its request waits behind another), as when it goes
/// at once: a staged body's known length had no room for it. A staged
/// trailer no `Trailer` field names is named (hyper writes only those).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_body_keeps_its_trailers() {
    let ds = Downstream::start().await;
    let sluice = Sluice::start(&config(ds.addr).replace("1000/s", "2/s"));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let c = &mut connect(addr);
        let post = |path: &str, declared: &str| {
            format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nX-Client: t\r\nTransfer-Encoding: chunked\r\n{declared}\r\n5\r\nhello\r\n0\r\nx-checksum: abc\r\n\r\n"
            )
        };
        // The first goes at once; the others wait 500 ms each, staged,
        // the last without a `Trailer` field naming its trailer.
        for (path, declared) in [
            ("/now", "Trailer: x-checksum\r\n"),
            ("/staged", "Trailer: x-checksum\r\n"),
            ("/undeclared", ""),
        ] {
            send(c, post(path, declared).as_bytes());
            let a = read_answer(c, false);
            assert_eq!(a.status, 200, "{a:?}");
        }
    })
    .await
    .unwrap();
    let seen = ds.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        let trailer = s.trailers.as_ref().and_then(|t| t.get("x-checksum"));
        assert_eq!(
            trailer.map(|v| v.as_bytes()),
            Some(&b"abc"[..]),
            "{}",
            s.path
        );
        assert_eq!(s.body_len, 5, "{}", s.path);
    }
}

/// `request_timeout` counts from the end of a streamed upload (and from
/// each part of it while it moves), not from its start: a body sent more
/// slowly than the timeout, to an upstream that answers once it has all
/// of it, is answered, not cut with 504. After the body's end the timeout
/// holds as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_cut_at_request_timeout() {
    let ds = Downstream::start().await;
    // 2 s; the body's parts 900 ms apart (1.1 s to spare for a busy
    // machine), 2.7 s in all.
    let sluice = Sluice::start(&config(ds.addr).replace("\"5s\"", "\"2s\""));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let c = &mut connect(addr);
        send(
            c,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: u\r\nContent-Length: 3\r\n\r\n",
        );
        for byte in [b"a", b"b", b"c"] {
            std::thread::sleep(Duration::from_millis(900));
            send(c, byte);
        }
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"abc"[..]), "{a:?}");
        // An upstream that takes longer than the timeout after the body's
        // end is still cut.
        send(
            c,
            b"POST /slow HTTP/1.1\r\nHost: t\r\nX-Client: u\r\nContent-Length: 1\r\n\r\nx",
        );
        let a = read_answer(c, false);
        assert_eq!(a.status, 504, "{a:?}");
    })
    .await
    .unwrap();
}

/// A head that comes in pieces, its end split between two of them (and a
/// bare-LF one), is served when its end is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_in_pieces_is_served_once_its_end_is_in() {
    let ds = Downstream::start().await;
    on_one_connection(ds.addr, |c| {
        for pieces in [
            &[
                &b"GET /pieces HTTP/1.1\r\nHo"[..],
                b"st: t\r\nX-Client: p\r",
                b"\n\r",
                b"\n",
            ][..],
            &[b"GET /lf HTTP/1.1\nHost: t\nX-Client: p\n", b"\n"],
        ] {
            for piece in pieces {
                send(c, piece);
                std::thread::sleep(Duration::from_millis(30));
            }
            let a = read_answer(c, false);
            assert_eq!((a.status, a.body.as_slice()), (200, &b"ok"[..]), "{a:?}");
        }
    })
    .await;
    let paths: Vec<String> = ds.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/pieces", "/lf"]);
}

/// A body of unknown length is sent chunked; the answer to a `HEAD` has
/// no body (the next response on the connection reads cleanly); a local
/// answer to a `HEAD` keeps its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_lengths_are_chunked_and_head_has_no_body() {
    on_one_connection(chunked_downstream(), |c| {
        send(c, b"GET /a HTTP/1.1\r\nHost: t\r\nX-Client: h\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!(a.status, 200, "{a:?}");
        assert_eq!(a.header("transfer-encoding"), Some("chunked"), "{a:?}");
        assert_eq!(a.body, b"hello world");

        send(c, b"HEAD /a HTTP/1.1\r\nHost: t\r\nX-Client: h\r\n\r\n");
        let a = read_answer(c, true);
        assert_eq!(a.status, 200, "{a:?}");

        // Refused locally (no key): a problem document's length, no body.
        send(c, b"HEAD /a HTTP/1.1\r\nHost: t\r\n\r\n");
        let a = read_answer(c, true);
        assert_eq!(a.status, 400, "{a:?}");
        assert!(
            a.header("content-length").is_some_and(|n| n != "0"),
            "{a:?}"
        );

        send(c, b"GET /b HTTP/1.1\r\nHost: t\r\nX-Client: h\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"hello world"[..]));
    })
    .await;
}

/// `Connection: close` gets its answer with `connection: close`, then the
/// connection ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_ends_the_connection_after_its_answer() {
    let ds = Downstream::start().await;
    on_one_connection(ds.addr, |c| {
        send(
            c,
            b"GET /last HTTP/1.1\r\nHost: t\r\nX-Client: c\r\nConnection: close\r\n\r\n",
        );
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"ok"[..]), "{a:?}");
        assert_eq!(a.header("connection"), Some("close"), "{a:?}");
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{rest:?}");
    })
    .await;
}

/// Bytes a client sends after a `Connection: close` request do not cost
/// it the answer: sluice closes its side and reads and drops them until
/// the client closes too (nginx's lingering close). Closing with them
/// unread resets the connection, and the kernel drops what of the answer
/// it has not sent yet: here most of a 32 MB answer, which the client
/// reads only after sending them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_after_a_close_do_not_reset_the_answer_before_it() {
    const BODY: usize = 32 << 20;
    let mut answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {BODY}\r\n\r\n").into_bytes();
    answer.resize(answer.len() + BODY, b'x');
    let upstream = canned_upstream(answer.leak(), 1, Duration::from_secs(5));
    on_one_connection(upstream, |c| {
        send(
            c,
            b"GET /last HTTP/1.1\r\nHost: t\r\nX-Client: c\r\nConnection: close\r\n\r\n",
        );
        // sluice is writing the answer by now, and reads nothing more.
        std::thread::sleep(Duration::from_millis(300));
        send(c, b"GET /after HTTP/1.1\r\nHost: t\r\nX-Client: c\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.len()), (200, BODY));
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "{} bytes after", rest.len());
    })
    .await;
}

/// A `header:Host` key is the host the request is for, as routing and the
/// upstream take it: an absolute-form target's authority, not the Host
/// header beside it (with that, a client set a fresh Host per request and
/// got a fresh bucket each time). Pure policing (capacity 0) at 1/h: the
/// later requests for a.example are refused whatever their Host says, and
/// however they spell the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_key_is_the_targets_authority_not_a_host_header_beside_it() {
    let ds = Downstream::start().await;
    let toml = config(ds.addr)
        .replace("header:X-Client", "header:Host")
        .replace(
            "rate = \"1000/s\"\ncapacity = 100",
            "rate = \"1/h\"\ncapacity = 0",
        );
    assert!(toml.contains("capacity = 0"));
    let sluice = Sluice::start(&toml);
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let mut statuses = Vec::new();
        // Nor by the spelling of one host: case, a trailing dot, a port.
        for (authority, host) in [
            ("a.example", "r1"),
            ("a.example", "r2"),
            ("A.Example.", "r3"),
            ("a.example:8080", "r4"),
        ] {
            let c = &mut connect(addr);
            let head = format!("GET http://{authority}/k HTTP/1.1\r\nHost: {host}\r\n\r\n");
            send(c, head.as_bytes());
            statuses.push(read_answer(c, false).status);
        }
        assert_eq!(statuses, [200, 429, 429, 429]);
    })
    .await
    .unwrap();
}

/// Host as RFC 9112 3.2 has it: an HTTP/1.1 request without a Host, or
/// with two, gets 400; an absolute-form target's authority comes before
/// Host; an HTTP/1.0 request without one reaches the upstream with the
/// upstream's own (sluice speaks HTTP/1.1 to it), and without the
/// `X-Forwarded-Host` its client made up (it used to pass: there was no
/// host to replace it with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_is_required_once_and_the_targets_authority_comes_first() {
    let ds = Downstream::start().await;
    let sluice = Sluice::start(&config(ds.addr));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        for bad in [
            &b"GET /none HTTP/1.1\r\nX-Client: h\r\n\r\n"[..],
            b"GET /two HTTP/1.1\r\nHost: a\r\nHost: b\r\nX-Client: h\r\n\r\n",
        ] {
            let c = &mut connect(addr);
            send(c, bad);
            let a = read_answer(c, false);
            assert_eq!(a.status, 400, "{a:?}");
        }
        let c = &mut connect(addr);
        send(
            c,
            b"GET http://a.example/abs HTTP/1.1\r\nHost: b.example\r\nX-Client: h\r\n\r\n",
        );
        assert_eq!(read_answer(c, false).status, 200);
        let c = &mut connect(addr);
        send(
            c,
            b"GET /old HTTP/1.0\r\nX-Client: h\r\nX-Forwarded-Host: evil.example\r\n\r\n",
        );
        let mut line = String::new();
        c.read_line(&mut line).unwrap();
        assert_eq!(line, "HTTP/1.0 200 OK\r\n");
    })
    .await
    .unwrap();
    let seen = ds.seen();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["/abs", "/old"]);
    let host = |i: usize| seen[i].headers.get("host").and_then(|h| h.to_str().ok());
    assert_eq!(host(0), Some("a.example"));
    assert_eq!(
        seen[0]
            .headers
            .get("x-forwarded-host")
            .and_then(|h| h.to_str().ok()),
        Some("a.example")
    );
    assert_eq!(host(1), Some(ds.addr.to_string().as_str()));
    assert_eq!(seen[1].headers.get("x-forwarded-host"), None);
}

/// A connection hyper serves (from a request with a body on) is kept for
/// `keepalive_timeout` between requests, like any other: hyper's header
/// timer ran while it waited for its next request and closed it at
/// `header_read_timeout` (1 s here, against 8 s). A head begun on it must
/// still end within `header_read_timeout` of its first byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_hyper_serves_keeps_its_keepalive_timeout() {
    let ds = Downstream::start().await;
    let cfg = config(ds.addr).replace(
        "[server]\n",
        "[server]\nheader_read_timeout = \"1s\"\nkeepalive_timeout = \"8s\"\n",
    );
    let sluice = Sluice::start(&cfg);
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let c = &mut connect(addr);
        send(
            c,
            b"POST /echo HTTP/1.1\r\nHost: t\r\nX-Client: k\r\nContent-Length: 5\r\n\r\nhello",
        );
        assert_eq!(read_answer(c, false).status, 200);
        std::thread::sleep(Duration::from_millis(2_500));
        send(c, b"GET /later HTTP/1.1\r\nHost: t\r\nX-Client: k\r\n\r\n");
        let a = read_answer(c, false);
        assert_eq!((a.status, a.body.as_slice()), (200, &b"ok"[..]), "{a:?}");
        // Half a head, then nothing: closed at the head's 1 s, not at the
        // 8 s of keep-alive.
        send(c, b"GET /half HTTP/1.1\r\nHo");
        let begun = Instant::now();
        let mut rest = Vec::new();
        let read = c.read_to_end(&mut rest);
        let took = begun.elapsed();
        assert!(read.is_ok(), "{read:?} after {took:?}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(5),
            "closed {took:?} after the head began"
        );
    })
    .await
    .unwrap();
}

/// An upstream that stops in the middle of its answer: after
/// `read_timeout` with nothing more, the client's connection ends with
/// the answer cut short (as the upstream cut it), instead of staying open
/// with the call's resources held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_stalls_mid_answer_is_cut_after_read_timeout() {
    // Then nothing, for longer than the test waits.
    let upstream = canned_upstream(
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
        1,
        Duration::from_secs(20),
    );
    let config = config(upstream).replace(
        "request_timeout = \"5s\"",
        "request_timeout = \"5s\"\nread_timeout = \"1s\"",
    );
    let sluice = Sluice::start(&config);
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let text = exchange(
            addr,
            b"GET /stall HTTP/1.1\r\nHost: t\r\nX-Client: s\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.ends_with("0123456789"), "{text}");
    })
    .await
    .unwrap();
}

/// An upstream answer with both Content-Length and Transfer-Encoding
/// (RFC 9112 6.3: the chunked body counts, and a proxy drops the length):
/// the client gets the whole body, not the length's first bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_both_length_and_chunked_reaches_the_client_whole() {
    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\nA\r\n0123456789\r\n0\r\n\r\n";
    both_clients_get(answer, Duration::ZERO, |text| {
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            !text.to_ascii_lowercase().contains("content-length: 5"),
            "{text}"
        );
        assert!(text.contains("0123456789"), "{text}");
    })
    .await;
}

/// An upstream that repeats an agreeing Content-Length (`2, 2`, then a
/// second line): the client gets one `content-length: 2` and the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agreeing_repeated_length_reaches_the_client_as_one() {
    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
    both_clients_get(answer, Duration::ZERO, |text| {
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        let lengths: Vec<&str> = text
            .lines()
            .filter(|l| l.to_ascii_lowercase().starts_with("content-length:"))
            .collect();
        assert_eq!(lengths.len(), 1, "{text}");
        assert_eq!(
            lengths[0].to_ascii_lowercase(),
            "content-length: 2",
            "{text}"
        );
        assert!(text.ends_with("\r\n\r\nok"), "{text}");
    })
    .await;
}

/// An upstream that answers with a transfer coding other than chunked
/// (here gzip, its body delimited by the close): the client gets 502
/// rather than the coded bytes without their label, on both clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_coding_other_than_chunked_is_a_502() {
    both_clients_get_502(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\nconnection: close\r\n\r\n\x1f\x8b\x08\x00",
        Duration::from_millis(0),
    )
    .await;
}

/// An upstream that answers `answer` (then holds its connection for
/// `hold`): what a request on either upstream client gets passes `check`.
async fn both_clients_get(answer: &'static [u8], hold: Duration, check: fn(&str)) {
    let upstream = canned_upstream(answer, BOTH_CLIENTS.len(), hold);
    let sluice = Sluice::start(&config(upstream));
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        for request in BOTH_CLIENTS {
            check(&exchange(addr, request));
        }
    })
    .await
    .unwrap();
}

/// [`both_clients_get`]: a 502 on either upstream client.
async fn both_clients_get_502(answer: &'static [u8], hold: Duration) {
    both_clients_get(answer, hold, |text| {
        assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    })
    .await;
}

/// An upstream that answers a request that asked for no switch with 101:
/// the client gets 502 (it could not follow the switch), on both clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_nobody_asked_for_is_a_502() {
    both_clients_get_502(
        b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n",
        Duration::from_millis(200),
    )
    .await;
}

/// A tunnel (a protocol switch the upstream accepted) stays open while
/// bytes cross it, and is closed once nothing crossed either way for the
/// upstream's read_timeout (2 s here): a peer that vanished without a FIN
/// no longer holds it for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_silent_both_ways_for_read_timeout_is_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf);
        let _ = conn.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
        );
        // Echo until either side closes.
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 || conn.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    });
    let config = config(upstream).replace(
        "request_timeout = \"5s\"",
        "request_timeout = \"5s\"\nread_timeout = \"2s\"",
    );
    let sluice = Sluice::start(&config);
    let addr = sluice.addr;
    tokio::task::spawn_blocking(move || {
        let c = &mut connect(addr);
        send(
            c,
            b"GET /ws HTTP/1.1\r\nHost: t\r\nX-Client: w\r\nConnection: upgrade\r\nUpgrade: echo\r\n\r\n",
        );
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(c.read(&mut byte).unwrap(), 1, "{head:?}");
            head.push(byte[0]);
        }
        assert!(head.starts_with(b"HTTP/1.1 101"), "{}", String::from_utf8_lossy(&head));
        // Bytes every 400 ms for 4 s: twice the timeout, still open.
        for i in 0..10u8 {
            std::thread::sleep(Duration::from_millis(400));
            send(c, &[b'a' + i]);
            assert_eq!(c.read(&mut byte).unwrap(), 1);
            assert_eq!(byte[0], b'a' + i);
        }
        // Then silence: closed by sluice.
        let t = Instant::now();
        // (Reads time out after 10 s: far past the 2 s timeout.)
        let n = c.read(&mut byte);
        assert!(matches!(n, Ok(0)), "{n:?} after {:?}", t.elapsed());
        assert!(t.elapsed() >= Duration::from_millis(1_800), "{:?}", t.elapsed());
    })
    .await
    .unwrap();
}

/// An upstream that answers every request on a connection with "ok",
/// the first after `first` (so that requests sent together open
/// connections of their own), and closes a connection idle for `idle`.
fn keep_alive_upstream(first: Duration, idle: Duration) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(64) {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(idle));
                let mut buf = [0u8; 4096];
                let mut delay = Some(first);
                // Each read is one request (sluice sends one at a time).
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {
                    if let Some(d) = delay.take() {
                        std::thread::sleep(d);
                    }
                    if conn
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Sockets to `peer` (its port) in CLOSE_WAIT: closed by the peer, not
/// yet by us.
fn close_wait_to(peer: SocketAddr) -> usize {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port = format!(":{:04X}", peer.port());
    tcp.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[2].ends_with(&port) && f[3] == "08"
        })
        .count()
}

/// Upstream connections a burst opened, idle in the pool below the one
/// that a request at a time keeps using, are closed once the upstream
/// has closed them, not kept in CLOSE_WAIT for the pool's life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_a_burst_left_are_closed_with_the_upstream() {
    let upstream = keep_alive_upstream(Duration::from_millis(200), Duration::from_millis(300));
    let cfg = config(upstream).replace("[server]\n", "[server]\nworkers = 1\n");
    let sluice = Sluice::start(&cfg);
    let addr = sluice.addr;
    let burst: Vec<_> = (0..8)
        .map(|i| {
            tokio::task::spawn_blocking(move || {
                let request = format!("GET /b{i} HTTP/1.1\r\nHost: t\r\nX-Client: b{i}\r\n\r\n");
                let c = &mut connect(addr);
                send(c, request.as_bytes());
                read_answer(c, false).status
            })
        })
        .collect();
    for b in burst {
        assert_eq!(b.await.unwrap(), 200);
    }
    let closed = tokio::task::spawn_blocking(move || {
        // A request every 100 ms keeps one connection in use; the others
        // go idle and the upstream closes them after 300 ms.
        let c = &mut connect(addr);
        for i in 0..12 {
            let request = format!("GET /s{i} HTTP/1.1\r\nHost: t\r\nX-Client: s\r\n\r\n");
            send(c, request.as_bytes());
            assert_eq!(read_answer(c, false).status, 200);
            std::thread::sleep(Duration::from_millis(100));
        }
        close_wait_to(upstream)
    })
    .await
    .unwrap();
    assert_eq!(closed, 0, "connections left in CLOSE_WAIT");
}

/// A connection lingering after `Connection: close` (its client keeps it
/// open) does not hold up a shutdown: the drain ends its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_connection_does_not_hold_up_a_shutdown() {
    let ds = Downstream::start().await;
    let mut sluice = Sluice::start(&config(ds.addr));
    let addr = sluice.addr;
    let kept = tokio::task::spawn_blocking(move || {
        let mut c = connect(addr);
        send(
            &mut c,
            b"GET /last HTTP/1.1\r\nHost: t\r\nX-Client: c\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(read_answer(&mut c, false).status, 200);
        c
    })
    .await
    .unwrap();
    let t = Instant::now();
    sluice.signal("TERM");
    let exited = tokio::task::spawn_blocking(move || {
        let status = sluice.wait_exit(Duration::from_secs(10));
        (status, t.elapsed())
    })
    .await
    .unwrap();
    assert!(exited.0.is_some_and(|s| s.success()), "{exited:?}");
    // The linger is 2 s; an idle drain takes milliseconds.
    assert!(exited.1 < Duration::from_millis(1_500), "{exited:?}");
    drop(kept);
}
