//! The shaping core: per-client bounded FIFO queues, the departure schedule,
//! the upstream-wide fair cap, and the pacer that releases requests on time.
//!
//! `engine` is pure (time is a parameter, no I/O, no async runtime); `pacer`
//! is the thin real-time shell around it.

pub mod engine;
pub mod pacer;
pub mod rate;

pub use engine::{
    Admission, ClientView, Engine, Limits, Policy, Probe, Rejection, RouteId, Ticket, UpstreamId,
};
pub use pacer::{AcquireError, Admitted, LagObserver, Shaper, Waiting};
pub use rate::{Nanos, Rate, RateError};
