//! HTTP/1.1 to the upstream, by sluice itself, for the exchange a proxy
//! makes most: a request without a body, on a keep-alive connection (TCP,
//! or TLS over it), that asks for no protocol switch. Everything else (a
//! body, HTTP/2, an upgrade) goes through hyper's client
//! ([`super::forward`]).
//!
//! Why: hyper's client drives each connection from a task of its own and
//! hands it requests through a channel, so every forwarded request woke a
//! second task and crossed a channel both ways; its connection task and
//! the send were about half of sluice's user time per forwarded request
//! (BENCHMARKS.md, "Where the CPU per forwarded request goes"). Here the
//! request's own task writes the head on a pooled connection and reads
//! the answer, and the response body reads the rest from the socket as
//! the client takes it; the connection goes back to the pool when the
//! body has been read to its end.
//!
//! What the upstream sees is what hyper sends: the head as the request
//! has it (field names in lower case, no body, so no framing of its own).
//! What is read is held to hyper's client defaults: at most 100 fields
//! and 408 KiB of head, 1xx interim answers skipped, the body framed by
//! RFC 9112 6.3 (no body after `HEAD`, 204 and 304; chunked when
//! `Transfer-Encoding` ends with it, `Content-Length` otherwise, all of
//! its values equal; else up to the connection's close). A connection is
//! used again only when the answer was HTTP/1.1 without `Connection:
//! close`, its length was known and nothing followed it.

use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HeaderName, HeaderValue, TRANSFER_ENCODING};
use http::request::Parts;
use http::{HeaderMap, Method, StatusCode, Version, response};
use hyper::body::{Body, Frame, SizeHint};
use smallvec::SmallVec;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use super::headers::one_length;
use super::in_flight::CallSlot;

/// At most this many fields in a response head (hyper's client default).
const MAX_HEADERS: usize = 100;
/// The largest response head (hyper's default read buffer limit).
const MAX_HEAD: usize = 8192 + 4096 * 100;
/// At most this many trailer fields.
const MAX_TRAILERS: usize = 64;
/// The longest chunk-size line (with its extensions).
const MAX_CHUNK_LINE: usize = 4096;
/// Read at a time: the head (and a small body with it), then the body:
/// from `READ_BODY`, doubled after each read that filled it, up to
/// `READ_MAX` (a large body in fewer, larger reads, as hyper does).
const READ_HEAD: usize = 8 * 1024;
const READ_BODY: usize = 16 * 1024;
const READ_MAX: usize = 256 * 1024;
/// Idle connections older than this are closed instead of used again
/// (hyper's pooled connections too).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections kept per upstream and worker (each pool).
pub const MAX_IDLE: usize = 512;

/// A connection to the upstream: plain TCP, or TLS over it.
pub type Io = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// The TCP socket under a connection.
fn tcp(io: &Io) -> &TcpStream {
    match io {
        Either::Left(tcp) => tcp,
        Either::Right(tls) => tls.get_ref().0,
    }
}

/// A connection to the upstream and its read buffer (empty between
/// exchanges; its allocation is used again).
pub struct Conn {
    io: Io,
    buf: BytesMut,
    /// Its last answer had no body by rule (`HEAD`, 204, 304): an
    /// upstream that sends one anyway is the usual source of bytes after
    /// an answer, so [`Conn::stale`] asks the socket itself.
    bodiless: bool,
}

impl Conn {
    pub fn new(io: Io) -> Conn {
        Conn {
            io,
            buf: BytesMut::new(),
            bodiless: false,
        }
    }

    /// Whether TLS holds more of what the upstream sent than the read
    /// took: a read that filled the buffer exactly at an answer's end
    /// leaves the rest of its record in rustls, where neither the buffer
    /// nor [`Conn::stale`]'s peek at the socket sees it. Bytes after an
    /// answer (a body sent to a HEAD, say) would be read as the next
    /// request's answer.
    fn leftover(&mut self) -> bool {
        match &mut self.io {
            Either::Left(_) => false,
            Either::Right(tls) => {
                let mut probe = [0u8; 1];
                !matches!(
                    std::io::Read::read(&mut tls.get_mut().1.reader(), &mut probe),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock
                )
            }
        }
    }

    /// Whether the upstream has sent something (most often its close)
    /// since the connection went idle: such a connection is not used
    /// again. Over TLS anything at all counts (a close_notify, most
    /// often; a late session ticket would cost a good connection, not a
    /// request).
    ///
    /// After a body-less answer the socket itself is asked (one `recv`
    /// with `MSG_PEEK`): the runtime's readiness, which a read that ended
    /// short cleared, does not show bytes that came after it (a body sent
    /// to a `HEAD` in a segment of its own) until the worker's I/O driver
    /// runs again, and a request taking the connection before then would
    /// read them as its own answer. After other answers the readiness is
    /// asked ([`Conn::seen_stale`]): the system call costs about 4 % of
    /// the CPU of a forwarded request (BENCHMARKS.md). Bytes that come
    /// after the connection was taken are read as the next answer, by
    /// this client as by nginx's and hyper's.
    fn stale(&self) -> bool {
        if !self.bodiless {
            return self.seen_stale();
        }
        let mut probe = [MaybeUninit::<u8>::uninit()];
        !matches!(
            socket2::SockRef::from(tcp(&self.io)).peek(&mut probe),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        )
    }

    /// Whether the runtime has seen the upstream send something since
    /// the connection went idle: no system call unless its I/O driver
    /// found the socket readable.
    fn seen_stale(&self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        let mut probe = [0u8; 1];
        tcp(&self.io)
            .poll_peek(&mut cx, &mut ReadBuf::new(&mut probe))
            .is_ready()
    }
}

/// One upstream's idle connections on one worker, the most recently used
/// last (so that a few stay warm); the oldest first, closed when they
/// have been idle for [`IDLE_TIMEOUT`] or the upstream closed them, and
/// when [`MAX_IDLE`] newer ones are kept.
#[derive(Default)]
pub struct Idle(Mutex<VecDeque<(Conn, Instant)>>);

impl Idle {
    pub fn take(&self) -> Option<Conn> {
        let mut idle = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((conn, since)) = idle.pop_back() {
            if since.elapsed() < IDLE_TIMEOUT && !conn.stale() {
                return Some(conn);
            }
        }
        None
    }

    fn put(&self, conn: Conn) {
        let now = Instant::now();
        let mut idle = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Connections a burst opened, and that fewer requests at once
        // never reach again from the warm end, are closed here; they
        // were kept open until the pool's end (in CLOSE_WAIT once the
        // upstream had timed them out).
        while let Some((oldest, since)) = idle.front()
            && (idle.len() >= MAX_IDLE
                || now.saturating_duration_since(*since) >= IDLE_TIMEOUT
                || oldest.seen_stale())
        {
            idle.pop_front();
        }
        idle.push_back((conn, now));
    }
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The head could not be written: the upstream never saw the request.
    #[error("the request could not be sent: {0}")]
    Unsent(io::Error),
    /// The connection ended before the first byte of an answer.
    #[error("the connection closed before an answer")]
    Unanswered,
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("the connection closed in the middle of the answer")]
    Cut,
    #[error("malformed response head: {0}")]
    Head(&'static str),
    #[error("the response head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("malformed chunked body")]
    Chunked,
}

impl From<httparse::Error> for Error {
    fn from(e: httparse::Error) -> Error {
        Error::Head(match e {
            httparse::Error::TooManyHeaders => "more than 100 fields",
            httparse::Error::Version => "not HTTP/1.x",
            httparse::Error::Status => "invalid status",
            _ => "does not parse",
        })
    }
}

/// Whether a request is one this client sends: no body, no framing
/// fields, no protocol switch, not `CONNECT`.
pub fn takes(parts: &Parts, body_empty: bool) -> bool {
    body_empty
        && parts.method != Method::CONNECT
        && !parts.headers.contains_key(TRANSFER_ENCODING)
        && !parts.headers.contains_key(http::header::UPGRADE)
        && parts
            .headers
            .get(CONTENT_LENGTH)
            .is_none_or(|v| v.as_bytes() == b"0")
}

/// Send the head of `parts` (a request [`takes`] accepts, in origin form)
/// on `conn` and read the answer's head; the body is read from the
/// returned [`Incoming`], which gives the connection to `idle` once it has
/// been read to its end.
pub async fn exchange(
    mut conn: Conn,
    parts: &Parts,
    idle: &Arc<Idle>,
) -> Result<(response::Parts, Incoming), Error> {
    // Room for the answer's head too: the head goes out of the same
    // buffer the answer is read into.
    conn.buf.clear();
    conn.buf.reserve(READ_HEAD);
    put_head(&mut conn.buf, parts);
    conn.io.write_all(&conn.buf).await.map_err(Error::Unsent)?;
    conn.io.flush().await.map_err(Error::Unsent)?;
    conn.buf.clear();
    let head_request = parts.method == Method::HEAD;
    loop {
        if let Some(head) = parse_head(&mut conn.buf, head_request)? {
            let Head {
                parts,
                framing,
                reuse,
            } = head;
            conn.bodiless = bodiless(parts.status, head_request);
            let body = Incoming {
                conn: Some(conn),
                framing,
                reuse,
                idle: idle.clone(),
                permit: None,
                read: READ_BODY,
            };
            return Ok((parts, body));
        }
        if conn.buf.len() >= MAX_HEAD {
            return Err(Error::HeadTooLarge);
        }
        let started = !conn.buf.is_empty();
        conn.buf.reserve(READ_HEAD);
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) if started => return Err(Error::Cut),
            Ok(0) => return Err(Error::Unanswered),
            Ok(_) => {}
            Err(e) if !started => {
                return Err(match e.kind() {
                    io::ErrorKind::ConnectionReset => Error::Unanswered,
                    _ => Error::Io(e),
                });
            }
            Err(e) => return Err(Error::Io(e)),
        }
    }
}

/// `METHOD target HTTP/1.1`, the fields, the empty line.
/// (`out` has room for a usual head already, and grows for a larger one.)
fn put_head(out: &mut BytesMut, parts: &Parts) {
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    out.put_slice(parts.method.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(target.as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    // A name's values come one after the other (split cookies were
    // joined into one field at the departure: `Upstream::rewrite`).
    for (name, value) in &parts.headers {
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"\r\n");
}

/// A response head read, and what its body is.
struct Head {
    parts: response::Parts,
    framing: Framing,
    reuse: bool,
}

/// Parse a final response head from the start of `buf` (interim 1xx
/// answers are dropped from it); `None` when more is needed. Field values
/// share the head's bytes (no copy each).
fn parse_head(buf: &mut BytesMut, head_request: bool) -> Result<Option<Head>, Error> {
    loop {
        // Not initialized first: 3 kB of stores per response otherwise.
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            buf,
            &mut fields,
        )? {
            httparse::Status::Complete(len) => len,
            httparse::Status::Partial => return Ok(None),
        };
        let code = parsed.code.unwrap_or(0);
        let status = StatusCode::from_u16(code).map_err(|_| Error::Head("invalid status"))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Error::Head("101 to a request that asked for no switch"));
        }
        if status.is_informational() {
            buf.advance(len);
            continue;
        }
        let version = match parsed.version {
            Some(1) => Version::HTTP_11,
            _ => Version::HTTP_10,
        };
        // Where each field lies in the head, so that the head can be split
        // off as one buffer the values then share.
        let base = buf.as_ptr() as usize;
        let mut at: SmallVec<[(usize, usize, usize, usize); 16]> = SmallVec::new();
        for field in parsed.headers.iter() {
            let name = field.name.as_ptr() as usize - base;
            let value = match field.value.is_empty() {
                true => 0,
                false => field.value.as_ptr() as usize - base,
            };
            at.push((
                name,
                name + field.name.len(),
                value,
                value + field.value.len(),
            ));
        }
        let head = buf.split_to(len).freeze();
        // And room for the `Via` added on the way back.
        let mut headers = HeaderMap::with_capacity(at.len() + 1);
        for &(name, name_end, value, value_end) in &at {
            let name = HeaderName::from_bytes(&head[name..name_end])
                .map_err(|_| Error::Head("invalid field name"))?;
            let value = HeaderValue::from_maybe_shared(head.slice(value..value_end))
                .map_err(|_| Error::Head("invalid field value"))?;
            headers.append(name, value);
        }
        let (framing, known) = framing(status, &mut headers, head_request)?;
        let reuse = known
            && version == Version::HTTP_11
            && !headers
                .get_all(CONNECTION)
                .iter()
                .any(|v| has_token(v, "close"));
        let mut parts = response::Response::new(()).into_parts().0;
        parts.status = status;
        parts.version = version;
        parts.headers = headers;
        return Ok(Some(Head {
            parts,
            framing,
            reuse,
        }));
    }
}

/// How the body is delimited (RFC 9112 6.3), and whether its end is known
/// without the connection's close. With both `Transfer-Encoding` and
/// `Content-Length`, the first wins, the second is removed and the
/// connection is not used again (6.3, point 3).
fn framing(
    status: StatusCode,
    headers: &mut HeaderMap,
    head_request: bool,
) -> Result<(Framing, bool), Error> {
    if bodiless(status, head_request) {
        // (The length a GET would have had, as one field.)
        one_length(headers);
        return Ok((Framing::Length(0), true));
    }
    if let Some(last) = headers.get_all(TRANSFER_ENCODING).iter().next_back() {
        let chunked = last
            .to_str()
            .ok()
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        let both = headers.remove(CONTENT_LENGTH).is_some();
        return Ok(match chunked {
            true => (Framing::Chunked(Chunk::Size), !both),
            false => (Framing::Close, false),
        });
    }
    let mut length = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        let text = value
            .to_str()
            .map_err(|_| Error::Head("invalid content-length"))?;
        for n in text.split(',') {
            let n = n.trim();
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Error::Head("invalid content-length"));
            }
            let n: u64 = n
                .parse()
                .map_err(|_| Error::Head("invalid content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(Error::Head("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    one_length(headers);
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::Close, false),
    })
}

/// Whether an answer has no body whatever its fields say (RFC 9112 6.3).
fn bodiless(status: StatusCode, head_request: bool) -> bool {
    head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED
}

/// Whether a comma-separated field value lists `token`.
fn has_token(value: &HeaderValue, token: &str) -> bool {
    value
        .to_str()
        .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

enum Framing {
    /// This many bytes still to come.
    Length(u64),
    Chunked(Chunk),
    /// Up to the connection's close.
    Close,
}

/// Where a chunked body is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Chunk {
    Size,
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    Trailers,
    Done,
}

/// A response body as it arrives on its connection.
pub struct Incoming {
    /// `None` once the body has ended (the connection pooled or closed).
    conn: Option<Conn>,
    framing: Framing,
    reuse: bool,
    idle: Arc<Idle>,
    /// The call's `max_concurrency` slot, held until the body is done with.
    permit: Option<CallSlot>,
    /// The next read's size.
    read: usize,
}

impl Incoming {
    pub fn hold(&mut self, permit: Option<CallSlot>) {
        self.permit = permit;
    }

    /// The body has ended: its connection goes back to the pool when it
    /// can be used again.
    fn finish(&mut self) {
        if let Some(mut conn) = self.conn.take()
            && self.reuse
            && conn.buf.is_empty()
            && !conn.leftover()
        {
            self.idle.put(conn);
        }
    }
}

impl Body for Incoming {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let step = match &mut this.framing {
                Framing::Length(0) => Step::End,
                Framing::Length(rest) if !conn.buf.is_empty() => {
                    let n = conn
                        .buf
                        .len()
                        .min(usize::try_from(*rest).unwrap_or(usize::MAX));
                    *rest -= n as u64;
                    Step::Frame(Frame::data(conn.buf.split_to(n).freeze()))
                }
                Framing::Length(_) => Step::More,
                Framing::Chunked(state) => match decode(state, &mut conn.buf) {
                    Ok(step) => step,
                    Err(e) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
                Framing::Close if !conn.buf.is_empty() => {
                    Step::Frame(Frame::data(conn.buf.split().freeze()))
                }
                Framing::Close => Step::More,
            };
            match step {
                Step::Frame(frame) => {
                    if let Framing::Length(0) | Framing::Chunked(Chunk::Done) = this.framing {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Step::End => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Step::More => {}
            }
            conn.buf.reserve(this.read);
            let room = conn.buf.capacity() - conn.buf.len();
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut conn.io),
                cx,
                &mut conn.buf
            ));
            if read.as_ref().is_ok_and(|&n| n == room) {
                this.read = (this.read * 2).min(READ_MAX);
            }
            match read {
                Ok(0) => {
                    this.conn = None;
                    return Poll::Ready(match this.framing {
                        Framing::Close => None,
                        _ => Some(Err(Error::Cut)),
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    this.conn = None;
                    return Poll::Ready(Some(Err(Error::Io(e))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.conn.is_none() || matches!(self.framing, Framing::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) if self.conn.is_some() => SizeHint::with_exact(n),
            _ if self.conn.is_none() => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        // A body nobody needed to read (HEAD, 204, empty) still ends its
        // exchange; one dropped midway takes its connection with it.
        if let Framing::Length(0) = self.framing {
            self.finish();
        }
    }
}

/// What the next part of a body is.
enum Step {
    Frame(Frame<Bytes>),
    /// More bytes are needed.
    More,
    End,
}

/// The next frame of a chunked body from `buf`.
fn decode(state: &mut Chunk, buf: &mut BytesMut) -> Result<Step, Error> {
    loop {
        match *state {
            // A size line starts with a digit: httparse reads an empty one
            // (`\r\n`, `;ext\r\n`) as 0, the body's end, where hyper and
            // nginx refuse it.
            Chunk::Size if buf.first().is_some_and(|b| !b.is_ascii_hexdigit()) => {
                return Err(Error::Chunked);
            }
            // The line ends at its first LF, which a CR must precede, and
            // is held to MAX_CHUNK_LINE whole or not: httparse reads an
            // extension up to a CRLF, so `5;a\nXYZ\r\n` would be one line
            // here where hyper refuses it and nginx ends it at the LF.
            Chunk::Size => {
                let within = &buf[..buf.len().min(MAX_CHUNK_LINE + 1)];
                let Some(lf) = within.iter().position(|&b| b == b'\n') else {
                    if buf.len() > MAX_CHUNK_LINE {
                        return Err(Error::Chunked);
                    }
                    return Ok(Step::More);
                };
                if lf == 0 || buf[lf - 1] != b'\r' {
                    return Err(Error::Chunked);
                }
                match httparse::parse_chunk_size(&buf[..=lf]) {
                    Ok(httparse::Status::Complete((used, size))) if used == lf + 1 => {
                        buf.advance(used);
                        *state = match size {
                            0 => Chunk::Trailers,
                            n => Chunk::Data(n),
                        };
                    }
                    _ => return Err(Error::Chunked),
                }
            }
            Chunk::Data(_) if buf.is_empty() => return Ok(Step::More),
            Chunk::Data(rest) => {
                let n = buf.len().min(usize::try_from(rest).unwrap_or(usize::MAX));
                let left = rest - n as u64;
                *state = match left {
                    0 => Chunk::DataEnd,
                    left => Chunk::Data(left),
                };
                return Ok(Step::Frame(Frame::data(buf.split_to(n).freeze())));
            }
            Chunk::DataEnd if buf.len() < 2 => return Ok(Step::More),
            Chunk::DataEnd if buf.starts_with(b"\r\n") => {
                buf.advance(2);
                *state = Chunk::Size;
            }
            Chunk::DataEnd => return Err(Error::Chunked),
            Chunk::Trailers if buf.starts_with(b"\r\n") => {
                buf.advance(2);
                *state = Chunk::Done;
            }
            Chunk::Trailers => {
                let mut fields = [httparse::EMPTY_HEADER; MAX_TRAILERS];
                let (used, trailers) = match httparse::parse_headers(buf, &mut fields) {
                    Ok(httparse::Status::Complete((used, fields))) => {
                        let mut map = HeaderMap::with_capacity(fields.len());
                        for f in fields.iter() {
                            let name = HeaderName::from_bytes(f.name.as_bytes())
                                .map_err(|_| Error::Chunked)?;
                            let value =
                                HeaderValue::from_bytes(f.value).map_err(|_| Error::Chunked)?;
                            map.append(name, value);
                        }
                        (used, map)
                    }
                    Ok(httparse::Status::Partial) if buf.len() <= MAX_HEAD => {
                        return Ok(Step::More);
                    }
                    _ => return Err(Error::Chunked),
                };
                buf.advance(used);
                *state = Chunk::Done;
                return Ok(Step::Frame(Frame::trailers(trailers)));
            }
            Chunk::Done => return Ok(Step::End),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;
    use proptest::prelude::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use super::*;

    /// An upstream on loopback that answers each request head it reads on
    /// one connection with the next of `answers` (each written in the
    /// given pieces, a little apart), reports the heads it read, and
    /// closes after the last answer when `close`.
    async fn upstream(
        answers: Vec<Vec<&'static [u8]>>,
        close: bool,
    ) -> (std::net::SocketAddr, mpsc::UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            for pieces in answers {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut chunk = [0u8; 1024];
                    let n = s.read(&mut chunk).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                let head: Vec<u8> = buf.drain(..end).collect();
                tx.send(String::from_utf8(head).unwrap()).unwrap();
                for piece in pieces {
                    s.write_all(piece).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            if !close {
                // Hold the connection until the client closes it.
                let mut rest = [0u8; 64];
                while s.read(&mut rest).await.is_ok_and(|n| n > 0) {}
            }
        });
        (addr, rx)
    }

    fn request(method: Method, target: &str) -> Parts {
        let mut parts = http::Request::new(()).into_parts().0;
        parts.method = method;
        parts.uri = target.parse().unwrap();
        parts.headers.insert("host", HeaderValue::from_static("up"));
        parts
            .headers
            .insert("x-forwarded-for", HeaderValue::from_static("127.0.0.1"));
        parts
    }

    async fn conn(addr: std::net::SocketAddr) -> Conn {
        Conn::new(Either::Left(TcpStream::connect(addr).await.unwrap()))
    }

    /// The body's bytes and trailers.
    async fn read(body: Incoming) -> Result<(Bytes, Option<HeaderMap>), Error> {
        let collected = body.collect().await?;
        let trailers = collected.trailers().cloned();
        Ok((collected.to_bytes(), trailers))
    }

    #[tokio::test]
    async fn a_sized_answer_is_read_and_its_connection_used_again() {
        let answer: &[u8] =
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\nx-a: c\r\n\r\nhello";
        let (addr, mut heads) = upstream(vec![vec![answer], vec![answer]], false).await;
        let idle = Arc::new(Idle::default());
        let (parts, body) = exchange(conn(addr).await, &request(Method::GET, "/p?q=1"), &idle)
            .await
            .unwrap();
        assert_eq!(
            heads.recv().await.unwrap(),
            "GET /p?q=1 HTTP/1.1\r\nhost: up\r\nx-forwarded-for: 127.0.0.1\r\n\r\n"
        );
        assert_eq!(parts.status, StatusCode::OK);
        assert_eq!(parts.version, Version::HTTP_11);
        let values: Vec<_> = parts.headers.get_all("x-a").iter().collect();
        assert_eq!(values, ["b", "c"]);
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(read(body).await.unwrap().0, "hello");
        // The same connection serves the next request (the upstream
        // accepts only one).
        let again = idle.take().expect("the connection went back to the pool");
        let (_, body) = exchange(again, &request(Method::GET, "/2"), &idle)
            .await
            .unwrap();
        assert!(
            heads
                .recv()
                .await
                .unwrap()
                .starts_with("GET /2 HTTP/1.1\r\n")
        );
        assert_eq!(read(body).await.unwrap().0, "hello");
    }

    #[tokio::test]
    async fn a_large_body_arrives_whole() {
        let body: &'static [u8] = (0..4 << 20)
            .map(|i: u32| (i % 251) as u8)
            .collect::<Vec<_>>()
            .leak();
        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
        let head: &'static [u8] = head.into_bytes().leak();
        let (addr, _heads) = upstream(vec![vec![head, body]], false).await;
        let idle = Arc::new(Idle::default());
        let (_, incoming) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
            .await
            .unwrap();
        assert!(read(incoming).await.unwrap().0 == body);
        assert!(idle.take().is_some());
    }

    #[tokio::test]
    async fn a_chunked_answer_arriving_in_pieces_keeps_its_data_and_trailers() {
        let pieces: Vec<&[u8]> = vec![
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n",
            b"\r\n5\r\nhel",
            b"lo\r\n6;ext=1\r\n world",
            b"\r\n0\r\nx-t",
            b": 1\r\n\r\n",
        ];
        let (addr, _heads) = upstream(vec![pieces], false).await;
        let idle = Arc::new(Idle::default());
        let (_, body) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
            .await
            .unwrap();
        let (data, trailers) = read(body).await.unwrap();
        assert_eq!(data, "hello world");
        assert_eq!(trailers.unwrap()["x-t"], "1");
        assert!(idle.take().is_some());
    }

    #[tokio::test]
    async fn an_answer_without_a_length_is_read_to_the_close_and_not_reused() {
        let (addr, _heads) = upstream(vec![vec![b"HTTP/1.1 200 OK\r\n\r\nab", b"c"]], true).await;
        let idle = Arc::new(Idle::default());
        let (_, body) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
            .await
            .unwrap();
        assert_eq!(read(body).await.unwrap().0, "abc");
        assert!(idle.take().is_none());
    }

    #[tokio::test]
    async fn head_204_and_304_answers_have_no_body() {
        for (method, answer) in [
            (
                Method::HEAD,
                &b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n"[..],
            ),
            (Method::GET, b"HTTP/1.1 204 No Content\r\n\r\n"),
            (
                Method::GET,
                b"HTTP/1.1 304 Not Modified\r\ncontent-length: 7\r\n\r\n",
            ),
        ] {
            let (addr, _heads) = upstream(vec![vec![answer]], false).await;
            let idle = Arc::new(Idle::default());
            let (parts, body) = exchange(conn(addr).await, &request(method, "/"), &idle)
                .await
                .unwrap();
            assert!(body.is_end_stream(), "{}", parts.status);
            assert_eq!(read(body).await.unwrap().0, "");
            assert!(idle.take().is_some(), "{}", parts.status);
        }
    }

    #[tokio::test]
    async fn interim_answers_are_skipped() {
        let answer: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
        let (addr, _heads) = upstream(vec![vec![answer]], false).await;
        let idle = Arc::new(Idle::default());
        let (parts, body) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
            .await
            .unwrap();
        assert_eq!(parts.status, StatusCode::CREATED);
        assert!(!parts.headers.contains_key("link"));
        assert_eq!(read(body).await.unwrap().0, "ok");
    }

    #[tokio::test]
    async fn answers_that_end_their_connection_are_not_reused() {
        for answer in [
            &b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 1\r\n\r\nx"[..],
            b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nx",
            // Both framings: chunked wins, the length goes.
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
        ] {
            let (addr, _heads) = upstream(vec![vec![answer]], false).await;
            let idle = Arc::new(Idle::default());
            let (parts, body) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
                .await
                .unwrap();
            if parts.headers.contains_key(TRANSFER_ENCODING) {
                assert!(!parts.headers.contains_key(CONTENT_LENGTH));
            }
            assert_eq!(read(body).await.unwrap().0, "x");
            assert!(idle.take().is_none());
        }
    }

    #[tokio::test]
    async fn malformed_or_cut_answers_are_errors() {
        let many: &'static [u8] = {
            let mut head = b"HTTP/1.1 200 OK\r\n".to_vec();
            for i in 0..=MAX_HEADERS {
                head.extend_from_slice(format!("x-{i}: v\r\n").as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            head.leak()
        };
        for answer in [
            &b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nx"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: +1\r\n\r\nx",
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\n\r\n",
            b"SMTP 220 hello\r\n\r\n",
            many,
        ] {
            let (addr, _heads) = upstream(vec![vec![answer]], false).await;
            let idle = Arc::new(Idle::default());
            let got = exchange(conn(addr).await, &request(Method::GET, "/"), &idle).await;
            assert!(
                matches!(got, Err(Error::Head(_))),
                "{}: {:?}",
                String::from_utf8_lossy(answer),
                got.err()
            );
        }
        // Closed before an answer; in the middle of a head; short of its
        // length; a chunk without its CRLF.
        for (answer, head_error) in [
            (&b""[..], Some("unanswered")),
            (b"HTTP/1.1 200 OK\r\ncontent-le", Some("cut")),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", None),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nxy\r\n",
                None,
            ),
        ] {
            let (addr, _heads) = upstream(vec![vec![answer]], true).await;
            let idle = Arc::new(Idle::default());
            let got = exchange(conn(addr).await, &request(Method::GET, "/"), &idle).await;
            match head_error {
                Some("unanswered") => assert!(
                    matches!(got, Err(Error::Unanswered)),
                    "{:?}",
                    got.as_ref().err()
                ),
                Some(_) => assert!(matches!(got, Err(Error::Cut)), "{:?}", got.as_ref().err()),
                None => {
                    let (_, body) = got.unwrap();
                    assert!(read(body).await.is_err());
                    assert!(idle.take().is_none());
                }
            }
        }
    }

    #[tokio::test]
    async fn a_pooled_connection_the_upstream_closed_is_not_taken() {
        let (addr, _heads) = upstream(
            vec![vec![b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]],
            true,
        )
        .await;
        let idle = Arc::new(Idle::default());
        let (_, body) = exchange(conn(addr).await, &request(Method::GET, "/"), &idle)
            .await
            .unwrap();
        drop(body);
        // The close arrives while the connection is idle; the worker's
        // driver sees it on its next turn.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let Some(conn) = idle.take() else { break };
            assert!(
                Instant::now() < deadline,
                "a closed connection stays in the pool"
            );
            idle.put(conn);
        }
    }

    #[test]
    fn a_head_is_written_as_the_request_has_it() {
        let mut parts = request(Method::DELETE, "/a/b?c=%20d");
        parts
            .headers
            .append(http::header::COOKIE, HeaderValue::from_static("a=1; b=2"));
        parts.headers.append("x-b", HeaderValue::from_static("2"));
        parts.headers.append("x-b", HeaderValue::from_static("3"));
        let mut out = BytesMut::new();
        put_head(&mut out, &parts);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "DELETE /a/b?c=%20d HTTP/1.1\r\nhost: up\r\nx-forwarded-for: 127.0.0.1\r\n\
             cookie: a=1; b=2\r\nx-b: 2\r\nx-b: 3\r\n\r\n"
        );
    }

    #[test]
    fn takes_only_bodiless_requests_without_a_switch() {
        let plain = request(Method::GET, "/");
        assert!(takes(&plain, true));
        assert!(!takes(&plain, false));
        let mut zero = request(Method::POST, "/");
        zero.headers
            .insert(CONTENT_LENGTH, HeaderValue::from_static("0"));
        assert!(takes(&zero, true));
        for (name, value) in [
            ("content-length", "3"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
        ] {
            let mut parts = request(Method::POST, "/");
            parts.headers.insert(name, HeaderValue::from_static(value));
            assert!(!takes(&parts, true), "{name}");
        }
        assert!(!takes(&request(Method::CONNECT, "/"), true));
    }

    /// Feed `wire` to the decoder in pieces cut at `cuts`; the data and
    /// trailers it gives.
    fn decode_in_pieces(
        wire: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, Option<HeaderMap>), Error> {
        let mut state = Chunk::Size;
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        let mut trailers = None;
        let mut at = 0;
        let mut ends: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        ends.push(wire.len());
        ends.sort_unstable();
        for end in ends {
            buf.extend_from_slice(&wire[at..end.max(at)]);
            at = end.max(at);
            loop {
                match decode(&mut state, &mut buf)? {
                    Step::Frame(f) => match f.into_data() {
                        Ok(d) => data.extend_from_slice(&d),
                        Err(f) => trailers = f.into_trailers().ok(),
                    },
                    Step::More => break,
                    Step::End => return Ok((data, trailers)),
                }
            }
        }
        Err(Error::Cut)
    }

    /// Bytes that come after a body-less answer, before the runtime has
    /// looked at the socket again, keep the connection from being used
    /// again: asked of the socket itself, not of the readiness a short
    /// read cleared. (A current-thread runtime: its I/O driver runs only
    /// when the test awaits something that is not ready.)
    #[tokio::test(flavor = "current_thread")]
    async fn bytes_after_a_head_answer_are_seen_before_the_connection_is_used() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut c = conn(addr).await;
        let (mut upstream, _) = listener.accept().unwrap();
        std::io::Write::write_all(
            &mut upstream,
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
        )
        .unwrap();
        let mut buf = [0u8; 1024];
        assert!(c.io.read(&mut buf).await.unwrap() > 0);
        c.bodiless = true;
        assert!(!c.stale());
        // The body a HEAD must not have, sent after its answer.
        std::io::Write::write_all(&mut upstream, b"hello").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(c.stale());
        // Peeked, not taken.
        assert_eq!(c.io.read(&mut buf).await.unwrap(), 5);
    }

    /// A `HEAD` (or 304) answer's agreeing repeated length is one field
    /// (the server side writes only a length made of digits).
    #[test]
    fn a_head_answers_repeated_length_is_one_field() {
        for (wire, head_request) in [
            (
                &b"HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n"[..],
                true,
            ),
            (
                b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n",
                false,
            ),
        ] {
            let mut buf = BytesMut::from(wire);
            let Ok(Some(head)) = parse_head(&mut buf, head_request) else {
                panic!("not parsed");
            };
            let lengths: Vec<_> = head.parts.headers.get_all(CONTENT_LENGTH).iter().collect();
            assert_eq!(lengths, ["5"]);
        }
    }

    #[test]
    fn a_chunk_size_line_without_a_size_is_refused() {
        for wire in [
            &b"3\r\nabc\r\n\r\nrest"[..],
            b"3\r\nabc\r\n;x=1\r\n\r\n",
            b" 0\r\n\r\n",
            // A bare LF ends the line (nginx) or is refused (hyper): never
            // read as part of an extension up to a later CRLF.
            b"5;a\nXYZ\r\nabcde\r\n0\r\n\r\n",
            b"3\nabc\r\n0\r\n\r\n",
        ] {
            assert!(
                matches!(decode_in_pieces(wire, &[]), Err(Error::Chunked)),
                "{}",
                String::from_utf8_lossy(wire)
            );
        }
        let (data, _) = decode_in_pieces(b"3;x=1\r\nabc\r\n0\r\n\r\n", &[]).unwrap();
        assert_eq!(data, b"abc");
        // A line longer than MAX_CHUNK_LINE is refused, even whole in one
        // read.
        let mut long = b"3;x=".to_vec();
        long.extend(std::iter::repeat_n(b'y', MAX_CHUNK_LINE));
        long.extend_from_slice(b"\r\nabc\r\n0\r\n\r\n");
        assert!(matches!(decode_in_pieces(&long, &[]), Err(Error::Chunked)));
    }

    proptest! {
        /// Whatever an upstream sends, reading it never panics: random
        /// bytes, and a valid answer with random bytes overwritten.
        #[test]
        fn any_answer_is_read_without_panic(
            noise in prop::collection::vec(any::<u8>(), 0..600),
            at in prop::collection::vec((any::<usize>(), any::<u8>()), 0..16),
            head_request in any::<bool>(),
        ) {
            let valid = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: x, chunked\r\n\
                          connection: close\r\n\r\n3\r\nabc\r\n0\r\nt: 1\r\n\r\n";
            let mut mutated = valid.to_vec();
            for (i, b) in at {
                let n = mutated.len();
                mutated[i % n] = b;
            }
            for wire in [noise, mutated] {
                let mut buf = BytesMut::from(&wire[..]);
                if let Ok(Some(Head { framing: Framing::Chunked(mut state), .. })) =
                    parse_head(&mut buf, head_request)
                {
                    while let Ok(Step::Frame(_)) = decode(&mut state, &mut buf) {}
                }
            }
        }

        #[test]
        fn chunked_bodies_decode_however_they_are_cut(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..8),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
            trailer in any::<bool>(),
        ) {
            let mut wire = Vec::new();
            for c in &chunks {
                wire.extend_from_slice(format!("{:X};x=y\r\n", c.len()).as_bytes());
                wire.extend_from_slice(c);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"0\r\n");
            if trailer {
                wire.extend_from_slice(b"grpc-status: 0\r\n");
            }
            wire.extend_from_slice(b"\r\n");
            let (data, trailers) = decode_in_pieces(&wire, &cuts).unwrap();
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(trailers.is_some(), trailer);
        }
    }
}
