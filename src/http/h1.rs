//! HTTP/1.1 served by sluice itself for the requests a proxy sees most:
//! those without a body. Everything else on a connection (a body, a
//! protocol switch, `Expect`, `TE`, HTTP/1.0, `CONNECT`, a head that
//! does not parse) is handed to hyper at the request's first byte, with the
//! bytes read so far, and hyper serves the connection from there on; so
//! do HTTP/2 connections (prior knowledge), told by their preface.
//!
//! Why: while a request is held in its queue, hyper keeps the connection's
//! read buffer (8 KiB, its first page written), a write buffer and the
//! request's boxed future, which made a held HTTP/1.1 request cost twice
//! what an HTTP/2 stream does. Here a head is read on the stack into a
//! buffer of its own size, which the request's values and target share
//! (a request that waits is then packed like any other:
//! [`super::headers::pack`]), and the request's future lives inside the
//! connection's task. (BENCHMARKS.md, "Memory per held request".)
//!
//! What a client sees is what hyper does: the same limits (a head past
//! `max_header_size` or with more than 100 fields gets hyper's 431, a
//! malformed one its 400, both by handing it over), a `Date` header, the
//! body framed by `Content-Length` when its size is known and chunked
//! otherwise, `Connection: close` on the last response. A client that
//! closes its connection while its request waits withdraws the request, as
//! with hyper (no half-close). A head that started arriving is dropped
//! with the connection after `header_read_timeout`, and an idle connection
//! after its idle timeout ([`super::conn`]).

use std::cell::RefCell;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http::header::{
    CONNECTION, CONTENT_LENGTH, DATE, EXPECT, HeaderName, HeaderValue, TE, TRANSFER_ENCODING,
    UPGRADE,
};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::TcpStream;
use tracing::debug;

use super::conn::{Close, ConnState, Conns, Reason};
use super::handler::Handler;
use super::response::ProxyBody;
use super::stall::Stall;

/// At most this many header fields (hyper's limit: a head with more goes
/// to hyper, which answers 431).
const MAX_HEADERS: usize = 100;
/// Targets this long go to hyper (it answers 414).
const MAX_TARGET: usize = u16::MAX as usize - 1;
/// Read at a time (on the stack) while a head arrives.
const READ_SIZE: usize = 4096;
/// Body data up to this size is copied next to what precedes it and
/// written in one call; larger data is written from its own buffer.
const COPY_MAX: usize = 16 * 1024;
/// HTTP/2's connection preface starts so; no HTTP/1.1 method does.
const H2_PREFACE: &[u8] = b"PRI";

/// A request's body as the handler gets it: none (a request read here),
/// or hyper's.
#[derive(Debug)]
pub enum RequestBody {
    Empty,
    Hyper(Incoming),
}

impl From<Incoming> for RequestBody {
    fn from(body: Incoming) -> RequestBody {
        RequestBody::Hyper(body)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RequestBody::Empty => Poll::Ready(None),
            RequestBody::Hyper(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Empty => true,
            RequestBody::Hyper(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Empty => SizeHint::with_exact(0),
            RequestBody::Hyper(body) => body.size_hint(),
        }
    }
}

/// A connection handed to hyper: the bytes already read, then the socket.
/// A write that waits `send_timeout` for the client to read fails (hyper
/// has no such limit of its own), which ends the connection.
pub struct Rewind {
    prefix: Bytes,
    io: TcpStream,
    /// `send_timeout`, for writes.
    stall: Stall,
    /// HTTP/1.1: told of bytes read, which start the clock of a head
    /// when the connection is idle ([`Conns::head_bytes`]). Weak: after a
    /// protocol switch the tunnel keeps this socket, and the connection's
    /// state must go with its task (its entry in the idle queue, upgraded,
    /// would take an eviction that closes nothing).
    heads: Option<(Arc<Conns>, Weak<ConnState>)>,
}

impl Rewind {
    /// `result` of a write, failed once it has waited `send_timeout` since
    /// the last write that made progress.
    fn limit<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        self.stall
            .check(cx, result)
            .map(|r| r.unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into())))
    }
}

impl AsyncRead for Rewind {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before
            && let Some((conns, state)) = &this.heads
            && let Some(state) = state.upgrade()
        {
            conns.head_bytes(&state);
        }
        read
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        this.limit(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.limit(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// How a connection goes on when this module is done with it.
pub enum Next {
    /// Closed (or to be dropped): the peer left, the connection was idle
    /// too long, or it ended after its last response.
    Closed,
    /// For hyper from here on: HTTP/2, or a request this module leaves to
    /// hyper (it is the first of the bytes given back).
    Hyper { io: Rewind, h2: bool },
}

/// What serving a connection needs from its worker.
pub struct Session<'a> {
    pub handler: &'a Arc<Handler>,
    pub conns: &'a Arc<Conns>,
    pub state: &'a Arc<ConnState>,
    pub peer: &'a SocketAddr,
    /// `server.max_header_size`.
    pub max_head: usize,
}

/// A request head read and accepted here.
struct Head {
    req: Request<RequestBody>,
    /// No `Connection: close` from the client.
    keep_alive: bool,
    /// A `HEAD` request: its response has no body.
    head: bool,
}

#[expect(
    clippy::large_enum_variant,
    reason = "returned once per head and taken apart at once; boxing would add an allocation per request"
)]
enum Parsed {
    /// More bytes needed.
    Partial,
    /// For hyper, from its first byte.
    Hyper,
    /// Consumed and not a request (400).
    Bad,
    Request(Head),
}

/// Serve `stream` until it closes or is handed to hyper. (An `async`
/// block, not an `async fn`, which would keep a second copy of each
/// argument in the connection's task.)
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps a second copy of each argument in every connection's task"
)]
pub fn serve(s: Session<'_>, mut stream: TcpStream) -> impl Future<Output = Next> + Send + '_ {
    async move {
        let mut buf = BytesMut::new();
        let mut first = true;
        // One timer for the connection's life, for its idle and header
        // deadlines: moving a registered timer later costs nothing, while
        // a new one per request would be registered (and wake the
        // worker's driver) every time.
        let timer = tokio::time::sleep(s.conns.keepalive_timeout);
        tokio::pin!(timer);
        loop {
            // The next head: from what is already read, else from the socket.
            let Head {
                req,
                keep_alive,
                head,
            } = {
                // In a block: `started` would otherwise stay in the task
                // while the request waits.
                let mut started = None;
                // How much of `buf` was looked at for a head's end: a head
                // that comes in pieces is parsed again only once its end
                // may be in (a 1 MiB head read 4 KiB at a time would
                // otherwise be parsed whole 256 times).
                let mut scanned = None;
                loop {
                    let again = scanned
                        .is_none_or(|from| buf.len() >= s.max_head || may_end_head(&buf, from));
                    scanned = Some(buf.len());
                    if !buf.is_empty() && again {
                        if first && H2_PREFACE.starts_with(&buf[..buf.len().min(H2_PREFACE.len())])
                        {
                            if buf.len() >= H2_PREFACE.len() {
                                return hand_over(buf, stream, None, s.conns.send_timeout);
                            }
                        } else {
                            let bad = match parse(&mut buf, s.max_head) {
                                Parsed::Request(head) => break head,
                                Parsed::Hyper => {
                                    let heads = (s.conns.clone(), Arc::downgrade(s.state));
                                    return hand_over(
                                        buf,
                                        stream,
                                        Some(heads),
                                        s.conns.send_timeout,
                                    );
                                }
                                Parsed::Bad => true,
                                Parsed::Partial => false,
                            };
                            if bad {
                                let _ =
                                    send(&mut stream, &bad_request(), s.conns.send_timeout).await;
                                Box::pin(linger(&mut stream, &s.state.close)).await;
                                return Next::Closed;
                            }
                        }
                    }
                    // Part of a head (parsed or not): its header timeout
                    // runs from now (a whole head, the usual case, never
                    // reads the clock here).
                    if !buf.is_empty() {
                        started.get_or_insert_with(Instant::now);
                    }
                    if !read_more(&s, &stream, &mut buf, started, timer.as_mut()).await {
                        return Next::Closed;
                    }
                }
            };
            first = false;
            // Nothing left over (no pipelining): the read buffer goes, so
            // that a held request does not keep it.
            if buf.is_empty() {
                buf = BytesMut::new();
            }
            // While the answer is awaited, the socket is watched: a client
            // that leaves withdraws its request (the future is dropped);
            // what it sends meanwhile (pipelined) is kept, up to a head's
            // limit. (In a block of its own: the answer's future then
            // shares its place in the connection's task with the response
            // being written, instead of being kept beside it.) The request
            // counts as in flight until its answer is written: a
            // connection whose client does not read is not idle (never
            // evicted as one); `send_timeout` ends it.
            let guard = s.conns.request(s.state);
            let response = {
                let answer = s.handler.handle(req, *s.peer);
                tokio::pin!(answer);
                let mut watching = true;
                loop {
                    tokio::select! {
                        // The answer first: a refusal is ready at once, and
                        // then the socket is not even looked at.
                        biased;
                        response = &mut answer => break response,
                        ready = stream.readable(), if watching => {
                            if ready.is_err() {
                                return Next::Closed;
                            }
                            match read_into(&stream, &mut buf) {
                                Ok(0) => return Next::Closed,
                                Ok(_) => watching = buf.len() < s.max_head,
                                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                                Err(_) => return Next::Closed,
                            }
                        }
                    }
                }
            };
            let close = !keep_alive || s.state.close.reason().is_some();
            let written = write_response(&mut stream, response, head, close, s.conns.send_timeout);
            if let Err(e) = written.await {
                debug!(peer = %s.peer, error = %e, "connection ended with an error");
                return Next::Closed;
            }
            drop(guard);
            if close {
                Box::pin(linger(&mut stream, &s.state.close)).await;
                return Next::Closed;
            }
        }
    }
}

/// `heads`: for HTTP/1.1 (`None`: HTTP/2).
fn hand_over(
    buf: BytesMut,
    io: TcpStream,
    heads: Option<(Arc<Conns>, Weak<ConnState>)>,
    send_timeout: Duration,
) -> Next {
    Next::Hyper {
        h2: heads.is_none(),
        io: Rewind {
            prefix: buf.freeze(),
            io,
            stall: Stall::new(send_timeout),
            heads,
        },
    }
}

/// Wait for more bytes of a head: `false` when the connection is to close
/// instead (the peer left, shutdown, eviction, or its idle or header
/// timeout passed). `started` is when the head's first byte arrived.
///
/// A plain function around an `async` block: the deadline is set before
/// the wait, and the wait's state (part of every connection's task)
/// carries no copies of the arguments.
fn read_more<'a>(
    s: &'a Session<'_>,
    stream: &'a TcpStream,
    buf: &'a mut BytesMut,
    started: Option<Instant>,
    mut timer: Pin<&'a mut tokio::time::Sleep>,
) -> impl Future<Output = bool> + Send + 'a {
    let idle = s
        .conns
        .idle_deadline(s.state)
        .unwrap_or_else(|| Instant::now() + s.conns.keepalive_timeout);
    let deadline = match started {
        Some(t) => idle.min(t + s.conns.header_read_timeout),
        None => idle,
    };
    if timer.deadline() != deadline.into() {
        timer.as_mut().reset(deadline.into());
    }
    async move {
        loop {
            tokio::select! {
                ready = stream.readable() => {
                    if ready.is_err() {
                        return false;
                    }
                    match read_into(stream, buf) {
                        Ok(0) => return false,
                        Ok(_) => return true,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return false,
                    }
                }
                why = s.state.close.wait() => {
                    if why == Reason::Evicted {
                        debug!(peer = %s.peer, "idle connection closed for a new one");
                    }
                    return false;
                }
                () = timer.as_mut() => {
                    debug!(peer = %s.peer, "idle connection closed");
                    return false;
                }
            }
        }
    }
}

/// Read what the socket has (up to [`READ_SIZE`]) and append it to `buf`.
/// Read on the stack and copied, so that `buf` is only as large as what
/// arrived: a held request keeps no read buffer, and a socket that turns
/// out to have nothing (readiness is cleared only by a read that would
/// block) costs no allocation.
///
/// A read that did not fill the chunk took all there was, so the socket's
/// readiness is cleared at once rather than by one more read that would
/// block. (Safe on the worker's current-thread runtime: data that arrives
/// after this read is a new event, which its driver delivers at its next
/// turn.)
fn read_into(stream: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    let mut chunk = [0u8; READ_SIZE];
    let n = stream.try_read(&mut chunk)?;
    buf.extend_from_slice(&chunk[..n]);
    if n > 0 && n < READ_SIZE {
        let _ = stream.try_io(Interest::READABLE, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
    }
    Ok(n)
}

/// Whether a head's end (an empty line: `\n\r\n`, or `\n\n` which
/// httparse also takes) may be in `buf` past `from` (what was looked at
/// before; the last three bytes of it are looked at again, since an end
/// may straddle two reads).
fn may_end_head(buf: &[u8], from: usize) -> bool {
    let tail = buf.get(from.saturating_sub(3)..).unwrap_or_default();
    tail.windows(2).any(|w| w == b"\n\n") || tail.windows(3).any(|w| w == b"\n\r\n")
}

/// Parse a head from the start of `buf`; a complete one that is served
/// here is split off `buf`.
fn parse(buf: &mut BytesMut, max_head: usize) -> Parsed {
    // Not initialized first: 3 kB of stores per request otherwise.
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match parsed.parse_with_uninit_headers(buf, &mut fields) {
        Ok(httparse::Status::Complete(n)) if n <= max_head => n,
        Ok(httparse::Status::Partial) if buf.len() < max_head => return Parsed::Partial,
        _ => return Parsed::Hyper,
    };
    if parsed.version != Some(1) {
        return Parsed::Hyper;
    }
    let Some(method) = parsed
        .method
        .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
    else {
        return Parsed::Hyper;
    };
    let Some(target) = parsed.path.filter(|t| t.len() <= MAX_TARGET) else {
        return Parsed::Hyper;
    };
    if method == Method::CONNECT {
        return Parsed::Hyper;
    }
    // Where each part sits in `buf`, to slice the head once it is split off.
    let base = buf.as_ptr() as usize;
    let at = |part: &[u8]| -> Option<(usize, usize)> {
        if part.is_empty() {
            return Some((0, 0));
        }
        let start = (part.as_ptr() as usize).checked_sub(base)?;
        (start + part.len() <= len).then_some((start, part.len()))
    };
    let Some(target) = at(target.as_bytes()) else {
        return Parsed::Hyper;
    };
    let mut keep_alive = true;
    let mut names: SmallVec<[(HeaderName, (usize, usize)); 16]> = SmallVec::new();
    for field in parsed.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(field.name.as_bytes()) else {
            return Parsed::Hyper;
        };
        if name == CONTENT_LENGTH
            || name == TRANSFER_ENCODING
            || name == UPGRADE
            || name == EXPECT
            || name == TE
        {
            return Parsed::Hyper;
        }
        if name == CONNECTION {
            for token in field.value.split(|&b| b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if !token.eq_ignore_ascii_case(b"keep-alive") {
                    return Parsed::Hyper;
                }
            }
        }
        let Some(place) = at(field.value) else {
            return Parsed::Hyper;
        };
        names.push((name, place));
    }
    let head = buf.split_to(len).freeze();
    let slice = |(start, n): (usize, usize)| head.slice(start..start + n);
    let Ok(uri) = Uri::from_maybe_shared(slice(target)) else {
        return Parsed::Bad;
    };
    // Room for the five the departure adds (X-Forwarded-For, -Proto,
    // -Host, Via, Host): one allocation, not a second one and a copy when
    // they are added. (A request that waits keeps its head packed, not
    // this table.)
    let mut headers = HeaderMap::with_capacity(names.len() + 5);
    for (name, place) in names {
        let Ok(value) = HeaderValue::from_maybe_shared(slice(place)) else {
            return Parsed::Bad;
        };
        headers.append(name, value);
    }
    let is_head = method == Method::HEAD;
    let mut req = Request::new(RequestBody::Empty);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Parsed::Request(Head {
        req,
        keep_alive,
        head: is_head,
    })
}

/// Close after the last answer, the client's close asked for (or a head
/// refused): our FIN, then what the client still sends is read and
/// dropped until it closes too, for [`LINGER_TIME`] and [`LINGER_BYTES`]
/// at most. Closing with bytes unread makes the kernel reset the
/// connection, and a reset can destroy the answer before the client has
/// read it (nginx's `lingering_close`). A close of sluice's own (a drain,
/// an eviction: `close`), asked before or meanwhile, does not wait.
/// (Boxed by its callers: the connection's future need not carry its
/// timer.)
async fn linger(stream: &mut TcpStream, close: &Close) {
    if stream.shutdown().await.is_err() || close.reason().is_some() {
        return;
    }
    let (mut rest, mut sink) = ((&mut *stream).take(LINGER_BYTES), tokio::io::sink());
    let drain = tokio::time::timeout(LINGER_TIME, tokio::io::copy(&mut rest, &mut sink));
    tokio::select! {
        _ = drain => {}
        _ = close.wait() => {}
    }
}

/// How long, and how much, a closing connection reads and drops.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: u64 = 64 * 1024;

/// hyper's answer to a head it cannot read.
fn bad_request() -> Vec<u8> {
    let mut out =
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n".to_vec();
    put_date(&mut out);
    out.extend_from_slice(b"\r\n");
    out
}

/// `date: <now>\r\n`, formatted once a second per thread.
fn put_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != secs {
            *cached = (secs, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(cached.1.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}

/// `content-length: <n>\r\n` (the number by `itoa`, as hyper writes it,
/// without `fmt`).
fn put_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// How a response's body is delimited.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (`HEAD`, 1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
}

/// Write `response`: its head, then its body framed as hyper would.
///
/// The head is written out by a plain function first: the async part then
/// carries only the body and the bytes to send (the response's header
/// table would otherwise stay in the connection's task while it writes,
/// and size that task for every connection).
fn write_response(
    stream: &mut TcpStream,
    response: Response<ProxyBody>,
    head_request: bool,
    close: bool,
    limit: Duration,
) -> impl Future<Output = io::Result<()>> + Send + '_ {
    let (parts, body) = response.into_parts();
    let (out, framing) = response_head(&parts, &body, head_request, close);
    write_body(stream, body, out, framing, limit)
}

/// Write all of `bytes`, each wait for the client to read at most `limit`
/// (nginx's `send_timeout`). A write the socket takes at once, the usual
/// case, arms no timer.
async fn send(stream: &mut TcpStream, bytes: &[u8], limit: Duration) -> io::Result<()> {
    let write = stream.write_all(bytes);
    tokio::pin!(write);
    if let Some(done) = write.as_mut().now_or_never() {
        return done;
    }
    tokio::time::timeout(limit, write)
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

/// A response's head, as bytes, and how its body is delimited.
fn response_head(
    parts: &http::response::Parts,
    body: &ProxyBody,
    head_request: bool,
    close: bool,
) -> (Vec<u8>, Framing) {
    let status = parts.status;
    // The length is written by this function, not copied: only digits
    // (`parse` would take "+5"), and never on 1xx and 204 (RFC 9110 8.6).
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok());
    // Never a body nor a length (1xx, 204); never a body (also HEAD, 304).
    let bodiless = status.is_informational() || status == StatusCode::NO_CONTENT;
    let no_body = head_request || bodiless || status == StatusCode::NOT_MODIFIED;
    let framing = if no_body {
        Framing::None
    } else if let Some(n) = declared {
        Framing::Length(n)
    } else if let Some(n) = body.size_hint().exact() {
        Framing::Length(n)
    } else {
        Framing::Chunked
    };
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == CONNECTION || name == TRANSFER_ENCODING || name == CONTENT_LENGTH {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match (framing, declared) {
        (Framing::Length(n), _) => put_length(&mut out, n),
        // The length a GET would have had (HEAD, 304), as declared.
        (Framing::None, Some(n)) if !bodiless => put_length(&mut out, n),
        (Framing::None, None)
            if head_request && !bodiless && status != StatusCode::NOT_MODIFIED =>
        {
            // A body of its own (a refusal's text) says its length; an
            // upstream's answer without one says nothing, and an empty
            // body is no evidence of 0 (a GET may have been chunked).
            if let Some(n) = body.size_hint().exact().filter(|&n| n > 0) {
                put_length(&mut out, n);
            }
        }
        (Framing::Chunked, _) => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        _ => {}
    }
    if !parts.headers.contains_key(DATE) {
        put_date(&mut out);
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (out, framing)
}

/// Send `out` (the head and whatever the body adds), then the body.
async fn write_body(
    stream: &mut TcpStream,
    mut body: ProxyBody,
    mut out: Vec<u8>,
    framing: Framing,
    limit: Duration,
) -> io::Result<()> {
    if framing == Framing::None {
        return send(stream, &out, limit).await;
    }
    let mut sent = 0u64;
    loop {
        // The body's next frame: taken at once when it is there (so a
        // small response goes out in one write), else after what is
        // ready is written.
        let frame = match body.frame().now_or_never() {
            Some(frame) => frame,
            None => {
                if !out.is_empty() {
                    send(stream, &out, limit).await?;
                    out.clear();
                }
                body.frame().await
            }
        };
        let data = match frame {
            None => break,
            Some(Err(e)) => return Err(io::Error::other(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                // Trailers (HTTP/1.1 sends them only to a client that
                // asked, and such requests are hyper's) and empty data.
                _ => continue,
            },
        };
        sent += data.len() as u64;
        if let Framing::Length(n) = framing
            && sent > n
        {
            return Err(io::Error::other("the body is longer than its length"));
        }
        if framing == Framing::Chunked {
            out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
        }
        if data.len() <= COPY_MAX {
            out.extend_from_slice(&data);
        } else {
            send(stream, &out, limit).await?;
            out.clear();
            send(stream, &data, limit).await?;
        }
        if framing == Framing::Chunked {
            out.extend_from_slice(b"\r\n");
        }
        if out.len() >= COPY_MAX {
            send(stream, &out, limit).await?;
            out.clear();
        }
    }
    match framing {
        Framing::Chunked => out.extend_from_slice(b"0\r\n\r\n"),
        Framing::Length(n) if sent < n => {
            send(stream, &out, limit).await?;
            return Err(io::Error::other("the body ended before its length"));
        }
        _ => {}
    }
    if !out.is_empty() {
        send(stream, &out, limit).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::response::full;

    fn parsed(bytes: &[u8]) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(bytes);
        (parse(&mut buf, 16 * 1024), buf)
    }

    #[test]
    fn a_request_without_a_body_is_served_here_and_split_off() {
        let (p, rest) = parsed(
            b"GET /a?b=1 HTTP/1.1\r\nHost: t\r\nX-Client: k\r\nX-Client: j\r\n\r\nGET /next",
        );
        let Parsed::Request(head) = p else {
            panic!("not served here");
        };
        assert!(head.keep_alive && !head.head);
        assert_eq!(head.req.method(), Method::GET);
        assert_eq!(head.req.uri(), "/a?b=1");
        assert_eq!(head.req.headers()["host"], "t");
        let clients: Vec<_> = head.req.headers().get_all("x-client").iter().collect();
        assert_eq!(clients, ["k", "j"]);
        assert_eq!(&rest[..], b"GET /next");
    }

    #[test]
    fn a_heads_end_is_found_across_reads() {
        let head = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n";
        // Looked at up to any point short of the whole (a read then
        // brought the rest): the end is found, straddling reads or not.
        for from in 0..head.len() {
            assert!(may_end_head(head, from), "from {from}");
        }
        assert!(may_end_head(b"GET / HTTP/1.1\nHost: t\n\n", 10));
        assert!(!may_end_head(b"GET / HTTP/1.1\r\nHost: t\r\nX-A: b", 0));
    }

    #[test]
    fn a_head_answer_never_invents_a_length() {
        let head = |body: ProxyBody, declared: Option<&str>| {
            let mut r = Response::new(body);
            if let Some(n) = declared {
                r.headers_mut()
                    .insert(CONTENT_LENGTH, http::HeaderValue::from_str(n).unwrap());
            }
            let (parts, body) = r.into_parts();
            String::from_utf8(response_head(&parts, &body, true, false).0).unwrap()
        };
        // The upstream sent no length (its GET would be chunked): none.
        let h = head(full(Bytes::new()), None);
        assert!(!h.contains("content-length"), "{h}");
        // Its own length passes through; a body of ours says its size.
        assert!(head(full(Bytes::new()), Some("1234")).contains("content-length: 1234"));
        assert!(head(full(Bytes::from_static(b"refused")), None).contains("content-length: 7"));
    }

    #[test]
    fn one_length_is_written_and_none_on_1xx_and_204() {
        let answer = |status: u16, declared: &str, head_request: bool| {
            let mut r = Response::new(full(Bytes::from_static(b"abc")));
            *r.status_mut() = StatusCode::from_u16(status).unwrap();
            r.headers_mut().insert(
                CONTENT_LENGTH,
                http::HeaderValue::from_str(declared).unwrap(),
            );
            let (parts, body) = r.into_parts();
            let head = response_head(&parts, &body, head_request, false).0;
            let head = String::from_utf8(head).unwrap();
            let lengths: Vec<&str> = head
                .lines()
                .filter_map(|l| l.strip_prefix("content-length: "))
                .collect();
            assert!(
                !head.contains("transfer-encoding") || lengths.is_empty(),
                "{head}"
            );
            lengths.join(",")
        };
        assert_eq!(answer(200, "3", false), "3");
        // Not digits only: not copied, and not trusted as the framing.
        assert_eq!(answer(200, "+3", false), "3");
        assert_eq!(answer(204, "0", false), "");
        assert_eq!(answer(204, "5", false), "");
        assert_eq!(answer(304, "1234", false), "1234");
        assert_eq!(answer(200, "1234", true), "1234");
    }

    #[test]
    fn connection_close_and_head_are_noted() {
        let (p, _) = parsed(b"HEAD / HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n");
        let Parsed::Request(head) = p else {
            panic!("not served here");
        };
        assert!(!head.keep_alive && head.head);
    }

    #[test]
    fn what_is_not_ours_goes_to_hyper_untouched() {
        for head in [
            &b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            b"GET / HTTP/1.1\r\nConnection: Upgrade\r\n\r\n",
            b"GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
            b"GET / HTTP/1.1\r\nTE: trailers\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"CONNECT t:443 HTTP/1.1\r\n\r\n",
            b"BLAH\x01 / HTTP/9\r\n\r\n",
        ] {
            let (p, rest) = parsed(head);
            assert!(
                matches!(p, Parsed::Hyper),
                "{:?}",
                String::from_utf8_lossy(head)
            );
            assert_eq!(&rest[..], head, "consumed");
        }
    }

    #[test]
    fn a_head_is_partial_until_complete_or_over_the_limit() {
        assert!(matches!(
            parsed(b"GET / HTTP/1.1\r\nHost:").0,
            Parsed::Partial
        ));
        let mut long = BytesMut::from(&b"GET / HTTP/1.1\r\nX-Big: "[..]);
        long.extend_from_slice(&[b'a'; 100]);
        assert!(matches!(parse(&mut long, 64), Parsed::Hyper));
    }

    #[test]
    fn lengths_are_written_in_decimal() {
        for n in [0, 7, 10, 12_345, u64::MAX] {
            let mut out = Vec::new();
            put_length(&mut out, n);
            assert_eq!(out, format!("content-length: {n}\r\n").into_bytes());
        }
    }
}
