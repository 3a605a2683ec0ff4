//! sluice: a queue-based traffic shaper.
//!
//! Every request is filed under a client key in a bounded FIFO queue; a pacer
//! releases each client's requests exactly 1/r apart; a request that finds b
//! requests already waiting is refused at once. The library holds everything;
//! `main.rs` only parses the command line and runs.
#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod pacer;
pub mod plot;
pub mod shaper;
pub mod simulate;
pub mod smtp;
pub mod term;
pub mod tls;
pub mod top;
