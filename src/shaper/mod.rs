//! The shaping core, pure: per-client bounded FIFO queues, the departure
//! schedule, the upstream-wide fair cap, and rates. Time is a parameter
//! everywhere; nothing here reads a clock, blocks on I/O or spawns work.
//! The pacer (the `pacer` module) is the real-time shell around it.

mod engine;
pub mod rate;
mod shard;

pub use engine::{
    Admission, Budget, ClientView, Engine, Limits, Policy, Probe, Rejection, RouteId, Target,
    Ticket, UpstreamId, Wake,
};
pub use rate::{Nanos, Rate, RateError};
