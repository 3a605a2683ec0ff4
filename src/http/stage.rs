//! Staged bodies (DESIGN section 3): while a request waits for its
//! departure, its body is read into a bounded buffer, so that a client that
//! goes away is seen at once whatever its body (partial, chunked, behind
//! `Expect: 100-continue`), and its departure writes the whole request in
//! one go (a body still coming at the departure goes with it as far as it
//! came, the rest streamed: [`Staging::begun`]). Each body is bounded by
//! `max_staged_body` (past it while it waits: 413) and all staged bodies
//! together by `max_staged_bytes` (past it: 503), so a flood of large
//! queued bodies cannot grow memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};

use super::h1::RequestBody;

use crate::admission::ReadDeadline;
pub use crate::admission::{Room, StageBudget};

/// A body read in full, and the room it takes.
#[derive(Debug)]
pub struct Staged {
    pub data: Bytes,
    /// Boxed: rare, and a held request carries the field.
    pub trailers: Option<Box<HeaderMap>>,
    _room: Room,
}

/// Why a body could not be staged.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Larger than `max_staged_body` (413).
    #[error("the body is larger than {0} bytes")]
    TooLarge(usize),
    /// `max_staged_bytes` are staged already (503).
    #[error("too many request bodies are staged")]
    Full,
    /// The client went away while its body was read.
    #[error("the client went away")]
    Gone,
    /// The body was malformed (an invalid chunk): the client's error (400).
    #[error("the request body is malformed: {0}")]
    Malformed(hyper::Error),
    /// No part of the body came for `server.body_read_timeout`, or it came
    /// slower than `MIN_DATA_RATE` once that time was spent (408).
    #[error(
        "the request body stopped arriving, or came slower than {} bytes/s",
        crate::admission::MIN_DATA_RATE
    )]
    TimedOut,
}

/// A body read error: the client gone (the message cut short), or a
/// malformed body.
pub fn body_error(e: hyper::Error) -> StageError {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let cut_short = {
        let mut source = std::error::Error::source(&e);
        let mut io_gone = false;
        while let Some(s) = source {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                io_gone |= matches!(
                    io.kind(),
                    UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
                );
            }
            source = s.source();
        }
        io_gone
    };
    if cut_short || e.is_incomplete_message() || e.is_closed() || e.is_canceled() {
        StageError::Gone
    } else {
        StageError::Malformed(e)
    }
}

/// A body that was refused, and what is left of it to read.
#[derive(Debug)]
pub struct Refused {
    pub error: StageError,
    /// The unread rest, when the client may still be sending it.
    pub rest: Option<RequestBody>,
}

/// How much of a refused body is read (and dropped) so that the client,
/// still sending it, gets the refusal before the connection closes
/// (nginx's lingering close); past this, or after [`LINGER_TIME`], the
/// connection just closes.
const LINGER_BYTES: usize = 1 << 20;
const LINGER_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Read and drop what is left of a refused body, for a bounded while.
pub fn linger(mut rest: RequestBody) {
    tokio::spawn(async move {
        let reading = async {
            let mut read = 0usize;
            while let Some(Ok(frame)) = rest.frame().await {
                read += frame.data_ref().map_or(0, |d| d.len());
                if read > LINGER_BYTES {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER_TIME, reading).await;
    });
}

/// A body being staged: the part read so far, counted in the budget, and
/// the rest. A request that departs before its body is all read goes on
/// with what was read ([`Staging::begun`]), the rest streamed after it.
#[derive(Debug)]
pub struct Staging {
    body: RequestBody,
    data: BytesMut,
    trailers: Option<Box<HeaderMap>>,
    room: Room,
    deadline: ReadDeadline,
    declared: Option<usize>,
}

impl Staging {
    /// Start staging `body`: refused at once when its declared length is
    /// over `max_staged_body` (413) or does not fit in the budget now
    /// (503; a flood of large bodies). The room is taken as the bytes
    /// come: taken at once, a body declared large and sent at 500 bytes/s
    /// held all of it for as long as that took (256 such clients held a
    /// 256 MiB budget for half an hour, sending 128 kB/s in all).
    pub fn new(
        body: RequestBody,
        budget: &Arc<StageBudget>,
        idle: Duration,
    ) -> Result<Staging, Refused> {
        let declared = body
            .size_hint()
            .exact()
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
        let max = budget.max_body();
        if let Some(n) = declared
            && (n > max || !budget.fits(n))
        {
            let error = if n > max {
                StageError::TooLarge(max)
            } else {
                StageError::Full
            };
            return Err(Refused {
                error,
                rest: Some(body),
            });
        }
        Ok(Staging {
            body,
            data: BytesMut::new(),
            trailers: None,
            room: budget.room(),
            deadline: ReadDeadline::new(Instant::now(), idle),
            declared,
        })
    }

    /// Read to the end within the budget: its first part within `idle`,
    /// then at [`crate::admission::MIN_DATA_RATE`] bytes per second on
    /// average, and each part within `idle` of the one before. (A client
    /// that stops sending, or sends a byte now and then, would keep its
    /// room in the budget for as long as it keeps the connection; after
    /// its request departs, nothing else bounds it.) Cancel-safe: a part
    /// read is kept, and a read made again goes on from it (and from the
    /// same deadline). The body is copied into one buffer as it
    /// comes, and the buffer's size is what the budget counts: kept as
    /// the frames came, a body sent in 1-byte chunks would hold a 32-byte
    /// entry and a share of a read buffer per byte, many times what is
    /// counted.
    pub async fn read(&mut self, budget: &StageBudget) -> Result<(), StageError> {
        let max = budget.max_body();
        while let Some(frame) =
            tokio::time::timeout_at(self.deadline.at().into(), self.body.frame())
                .await
                .map_err(|_| StageError::TimedOut)?
        {
            let frame = frame.map_err(body_error)?;
            match frame.into_data() {
                Ok(part) => {
                    self.deadline.read(part.len(), Instant::now());
                    if self.data.len().saturating_add(part.len()) > max {
                        return Err(StageError::TooLarge(max));
                    }
                    if !append(&mut self.data, &part, &mut self.room, self.declared) {
                        return Err(StageError::Full);
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        self.trailers = Some(Box::new(t));
                    }
                }
            }
        }
        Ok(())
    }

    /// The body read in full ([`Staging::read`] ended well).
    pub fn finish(self) -> Staged {
        Staged {
            data: self.data.freeze(),
            trailers: self.trailers,
            _room: self.room,
        }
    }

    /// `error` ended the read: what is left to read of the body, when the
    /// client may still be sending it.
    pub fn refused(self, error: StageError) -> Refused {
        let rest = match error {
            StageError::TooLarge(_) | StageError::Full => Some(self.body),
            StageError::Gone | StageError::Malformed(_) | StageError::TimedOut => None,
        };
        Refused { error, rest }
    }

    /// What was read (forwarded first, its room held until then), and the
    /// rest of the body.
    pub fn begun(self) -> (Box<Begun>, RequestBody) {
        let first = Begun {
            data: self.data,
            trailers: self.trailers,
            ended: false,
            full: false,
            starved: false,
            room: Some(self.room),
        };
        (Box::new(first), self.body)
    }
}

/// Append `part` to `data`, the buffer's growth taken from `room` before
/// it is made: doubled (few copies) when the budget has room for that,
/// else to all the budget has left, so that a body that fits in the
/// budget is not refused for the way its buffer grows (doubled, a 72 kB
/// body's buffer would take 128 kB), nor copied whole for each part that
/// follows (grown to its exact size each time, a body sent a byte at a
/// time was copied once per byte), and never past a `declared` length.
/// `false` when the budget has no room for it.
fn append(data: &mut BytesMut, part: &[u8], room: &mut Room, declared: Option<usize>) -> bool {
    let len = data.len().saturating_add(part.len());
    if len > data.capacity() {
        let doubled = data
            .capacity()
            .saturating_mul(2)
            .min(declared.unwrap_or(usize::MAX))
            .max(len);
        // `reserve` grows to at least twice the capacity: right only when
        // that is what was taken (not when a declared length capped it).
        let twice = data.capacity().saturating_mul(2);
        match room.grow_within(len, doubled) {
            Some(total) if total >= doubled && doubled == twice => {
                data.reserve(doubled - data.len());
            }
            Some(total) => {
                let mut grown = BytesMut::with_capacity(total);
                grown.extend_from_slice(data);
                *data = grown;
            }
            None => return false,
        }
    }
    data.extend_from_slice(part);
    // What the allocator gave is what is counted (a first part of a few
    // bytes gets a few more).
    room.grow_to(data.capacity())
}

/// What a request sent while it waited, forwarded before the rest of its
/// body once it departs: a gRPC call's, or an upload's read while it
/// waited for a `max_concurrency` slot, read as it came (within
/// `max_staged_body` and the budget); or a staged body still coming at its
/// departure ([`Staging::begun`]). Left unread, a waiting call's messages would
/// hold its HTTP/2 connection's flow-control window, which the client's
/// other calls share: a backlog on one key would stall every call on the
/// connection. Unlike a staged body, the end is not waited for (a
/// streaming call's body may only end after its answer).
#[derive(Debug)]
pub struct Begun {
    data: BytesMut,
    trailers: Option<Box<HeaderMap>>,
    /// The end of the body was read.
    ended: bool,
    /// Reading stopped: `max_staged_body` reached; the rest waits in flow
    /// control until the call departs.
    full: bool,
    /// Reading paused: the budget has no room (what was read is counted
    /// whatever it says); tried again while the call waits (every
    /// [`STARVED_RETRY`]). Stopped for good, the call's unread data held
    /// its connection's window until it departed, and another client
    /// filling the budget stalled every call on it.
    starved: bool,
    /// Given back once the data is handed on.
    room: Option<Room>,
}

/// How often a waiting call whose reading paused for want of budget
/// tries again.
pub const STARVED_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

impl Begun {
    pub fn new(budget: &Arc<StageBudget>) -> Begun {
        Begun {
            data: BytesMut::new(),
            trailers: None,
            ended: false,
            full: false,
            starved: false,
            room: Some(budget.room()),
        }
    }

    /// Whether to read another part: not at the end, under `max`, and
    /// the budget not full. (What is read is counted as it is held, after
    /// the fact: a part read is held whatever the budget says, and room
    /// taken ahead for parts that never come would be counted for
    /// nothing: a unary call sends a few hundred bytes.)
    pub fn wants(&mut self, max: usize, budget: &StageBudget) -> bool {
        if self.ended || self.full {
            return false;
        }
        if self.data.len() >= max {
            self.full = true;
            return false;
        }
        self.starved = !budget.has_room();
        !self.starved
    }

    /// Reading paused for want of budget (see [`Begun::wants`]).
    pub fn starved(&self) -> bool {
        self.starved && !self.ended && !self.full
    }

    /// Read the next part of `body` into this.
    pub async fn read(&mut self, body: &mut RequestBody) -> Result<(), StageError> {
        match body.frame().await {
            None => self.ended = true,
            Some(frame) => match frame.map_err(body_error)?.into_data() {
                Ok(part) => {
                    self.data.extend_from_slice(&part);
                    // Counted as held, whatever the budget says; past
                    // it, reading pauses (`wants`) and the rest waits in
                    // flow control until there is room.
                    let cap = self.data.capacity();
                    if let Some(room) = self.room.as_mut() {
                        room.set_to(cap);
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        self.trailers = Some(Box::new(t));
                    }
                }
            },
        }
        Ok(())
    }

    /// The next frame to forward from what was read, if any; then, unless
    /// the end was read, the rest of the stream follows.
    pub fn next_frame(&mut self) -> Option<Frame<Bytes>> {
        if !self.data.is_empty() {
            self.room = None;
            return Some(Frame::data(std::mem::take(&mut self.data).freeze()));
        }
        self.trailers.take().map(|t| Frame::trailers(*t))
    }

    /// Nothing left to forward from what was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty() && self.trailers.is_none()
    }

    /// The end of the body was read.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Bytes read and not yet forwarded.
    pub fn len(&self) -> usize {
        self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::BytesMut;

    use super::{Begun, StageBudget, append};

    /// A body that fits in the budget is staged whatever its buffer's
    /// growth: nine 8 kB parts in a 100 kB budget (doubling alone would
    /// have wanted 128 kB for the ninth), and the parts after them go into
    /// the room taken, not into a copy each; then the budget is kept.
    #[test]
    fn a_buffer_takes_what_the_budget_has_left_when_doubling_would_not_fit() {
        let budget = Arc::new(StageBudget::new(1 << 20, 100_000));
        let mut room = budget.room();
        let mut data = BytesMut::new();
        for i in 1..=9 {
            assert!(
                append(&mut data, &[b'x'; 8_000], &mut room, None),
                "part {i}"
            );
            assert_eq!(data.len(), i * 8_000);
            assert!(room.bytes() >= data.capacity());
        }
        // The ninth took what was left, for the parts after it.
        assert_eq!(budget.used(), 100_000);
        assert_eq!(data.capacity(), 100_000);
        let before = data.as_ptr();
        for _ in 0..1_000 {
            assert!(append(&mut data, b"x", &mut room, None));
        }
        assert_eq!(data.as_ptr(), before, "grown, copied again");
        assert!(!append(&mut data, &[b'x'; 30_000], &mut room, None));
        assert_eq!(budget.used(), 100_000);
    }

    /// A body of a declared length is never given (nor charged) more
    /// room than that length: 20,000 bytes in 8 kB parts.
    #[test]
    fn a_declared_length_caps_the_buffer() {
        let budget = Arc::new(StageBudget::new(1 << 20, 1 << 20));
        let mut room = budget.room();
        let mut data = BytesMut::new();
        for part in [8_000, 8_000, 4_000] {
            assert!(append(
                &mut data,
                &vec![b'x'; part],
                &mut room,
                Some(20_000)
            ));
        }
        assert_eq!(data.len(), 20_000);
        assert_eq!(data.capacity(), 20_000);
        assert_eq!(budget.used(), 20_000);
    }

    #[test]
    fn a_waiting_call_starved_of_budget_reads_again_once_there_is_room() {
        let budget = Arc::new(StageBudget::new(1 << 20, 1_000));
        let mut call = Begun::new(&budget);
        assert!(call.wants(1 << 20, &budget));
        // Another client fills the budget: reading pauses...
        let mut other = budget.room();
        assert!(other.grow_to(1_000));
        assert!(!call.wants(1 << 20, &budget));
        assert!(call.starved());
        // ... and goes on once it has room again.
        drop(other);
        assert!(call.wants(1 << 20, &budget));
        assert!(!call.starved());
        // `max_staged_body` reached stops it for good.
        let mut small = Begun::new(&budget);
        small.data.extend_from_slice(&[0; 10]);
        assert!(!small.wants(10, &budget));
        assert!(!small.starved());
        assert!(!small.wants(1 << 20, &budget));
    }
}
