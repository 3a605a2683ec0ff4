//! Waits on a peer that may never end: a timer armed only when a read or
//! write has to wait, dropped when it makes progress, and failing it once
//! it has waited `limit` (nginx's `send_timeout` and `proxy_read_timeout`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::response::BodyError;

/// How long an I/O may wait without progress.
pub struct Stall {
    limit: Duration,
    armed: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Stall {
    pub fn new(limit: Duration) -> Stall {
        Stall { limit, armed: None }
    }

    /// `poll`, an I/O's outcome: its value once ready, `Err(limit)` once it
    /// has been pending for `limit` since it last made progress.
    pub fn check<T>(&mut self, cx: &mut Context<'_>, poll: Poll<T>) -> Poll<Result<T, Duration>> {
        if let Poll::Ready(v) = poll {
            self.armed = None;
            return Poll::Ready(Ok(v));
        }
        let limit = self.limit;
        let armed = self
            .armed
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(armed.as_mut().poll(cx));
        self.armed = None;
        Poll::Ready(Err(limit))
    }
}

/// An upstream's answer body that may stall: no part of it for the limit
/// ends it with an error, so an upstream that stops mid-answer does not
/// hold the client's connection and its call's slot for good.
pub struct Stalls<B> {
    body: B,
    stall: Stall,
}

impl<B> Stalls<B> {
    pub fn new(body: B, limit: Duration) -> Stalls<B> {
        Stalls {
            body,
            stall: Stall::new(limit),
        }
    }
}

impl<B> Body for Stalls<B>
where
    B: Body<Data = Bytes> + Unpin,
    BodyError: From<B::Error>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        Poll::Ready(match ready!(this.stall.check(cx, frame)) {
            Ok(frame) => frame.map(|f| f.map_err(BodyError::from)),
            Err(limit) => Some(Err(BodyError::Stalled(limit))),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
