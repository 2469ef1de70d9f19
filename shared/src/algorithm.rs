//! In-process twins of the Lua algorithms in `region-node/src/lua/decide.lua`.
//!
//! Used by the `local` fail mode (Redis unreachable), and as the reference
//! model the Lua script is tested against. Semantics match the script:
//! `evaluate` never mutates, `commit` charges, `refund` gives back without
//! going below zero.

use crate::config::{Algorithm, Limit};

/// The outcome of evaluating one tier for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evaluation {
    pub allowed: bool,
    /// Units left after this request (if allowed) or now (if denied).
    pub remaining: u64,
    /// Milliseconds until the window resets / the bucket is full again.
    pub reset_ms: u64,
    /// When denied: milliseconds until the same request could pass;
    /// `None` when it never can (cost above limit or burst).
    pub retry_ms: Option<u64>,
}

/// State of one tier for one tenant (or tenant and key).
#[derive(Debug, Clone)]
pub struct TierState {
    _todo: (),
}

impl TierState {
    pub fn new(_limit: &Limit) -> Self {
        let _ = Algorithm::FixedWindow;
        TierState { _todo: () }
    }
}
