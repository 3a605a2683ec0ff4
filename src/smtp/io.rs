//! A connection that starts in plain text and may turn to TLS (STARTTLS),
//! on either side, and the input buffer both sides parse from: SMTP
//! pipelining means bytes past the current command or reply belong to the
//! next one and must never be dropped (RFC 2920 section 3.2).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// How many bytes one read takes at most.
const READ_CHUNK: usize = 16 * 1024;

/// A plain or TLS connection.
pub enum Stream {
    Plain(TcpStream),
    /// Inbound, after STARTTLS.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    /// To an upstream, after STARTTLS or from the start.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// Between taking the plain stream and the TLS handshake's end (a
    /// failed handshake leaves it so).
    Gone,
}

impl Stream {
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Server(_) | Stream::Client(_))
    }

    /// Turn a plain inbound connection to TLS.
    pub async fn accept_tls(&mut self, acceptor: &TlsAcceptor) -> io::Result<()> {
        let Stream::Plain(tcp) = std::mem::replace(self, Stream::Gone) else {
            return Err(io::Error::other("TLS is already on"));
        };
        *self = Stream::Server(Box::new(acceptor.accept(tcp).await?));
        Ok(())
    }

    /// Turn a plain connection to an upstream to TLS.
    pub async fn connect_tls(
        &mut self,
        config: Arc<rustls::ClientConfig>,
        name: ServerName<'static>,
    ) -> io::Result<()> {
        let Stream::Plain(tcp) = std::mem::replace(self, Stream::Gone) else {
            return Err(io::Error::other("TLS is already on"));
        };
        let connector = TlsConnector::from(config);
        *self = Stream::Client(Box::new(connector.connect(name, tcp).await?));
        Ok(())
    }

    /// Without waiting: whether the peer has closed the connection or sent
    /// something unasked (an idle upstream's 421). An idle pooled session
    /// for which this holds is not used again.
    pub fn closed_or_talking(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        Pin::new(self).poll_read(&mut cx, &mut buf).is_ready()
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Gone => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Gone => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Gone => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Server(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Client(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Gone => Poll::Ready(Ok(())),
        }
    }
}

/// Bytes read and not yet parsed.
#[derive(Default)]
pub struct InBuf {
    data: BytesMut,
    /// When bytes last came.
    last: Option<Instant>,
    /// When the stream's end first came.
    end: Option<Instant>,
}

impl InBuf {
    /// What is left to parse.
    pub fn unread(&self) -> &[u8] {
        &self.data
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// `n` bytes of [`InBuf::unread`] are parsed.
    pub fn consume(&mut self, n: usize) {
        self.data.advance(n.min(self.data.len()));
    }

    /// Drop everything unread (RFC 3207: plain text sent after STARTTLS
    /// must not be acted on).
    pub fn discard(&mut self) {
        self.data.clear();
    }

    /// Read once more from `stream`; `Ok(0)` at its end. Cancel-safe: a
    /// read given up on loses nothing and adds nothing.
    pub async fn fill<S: AsyncRead + Unpin>(&mut self, stream: &mut S) -> io::Result<usize> {
        self.data.reserve(READ_CHUNK);
        let n = stream.read_buf(&mut self.data).await?;
        if n > 0 {
            self.last = Some(Instant::now());
        } else if self.end.is_none() {
            self.end = Some(Instant::now());
        }
        Ok(n)
    }

    /// How long after its last bytes the stream's end came, once it has.
    pub fn end_after_data(&self) -> Option<Duration> {
        Some(self.end?.saturating_duration_since(self.last?))
    }

    /// When the last bytes came.
    pub fn last_data(&self) -> Option<Instant> {
        self.last
    }
}
