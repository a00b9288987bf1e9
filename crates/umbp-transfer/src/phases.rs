//! The `tracing` spans a same-host batch exchange records around its steps (GET_KEYS, PUT_KEYS:
//! `KeyedClient::get_shared_batch`, `put_shared_batch_confirmed`), so a breakdown
//! (`umbp bench --breakdown`) shows where a batch's time goes between the holder's answer, the
//! copies and the end of the exchange. The pool client's phase names (`umbp-peer`'s
//! `pool_client::phases`) include these; they are declared here because these steps run here.
//!
//! Every span is at TRACE level with target [`TARGET`]: without a subscriber that wants them, a
//! span costs the cached callsite-interest check. Each runs on the thread that makes the exchange,
//! inside the pool client's `umbp.get.keyed` / `umbp.put.keyed` span of the whole batch.

/// The target of every phase span (the pool client's too).
pub const TARGET: &str = "umbp::phase";

/// A batch get chunk: its request sent, the holder's answer read (the holder resolves every key
/// under its lease), and its copies planned.
pub const GET_KEYED_REPLY: &str = "umbp.get.keyed.reply";
/// A batch get chunk's copies, fanned out over the copy pool, each checked as it lands.
pub const GET_KEYED_COPY: &str = "umbp.get.keyed.copy";
/// A batch get chunk's settle frame (ending every lease). Sent after the chunk's answers went back
/// to the caller, so it may close after the batch has returned (a breakdown stopped at the
/// batch's end then misses it).
pub const GET_KEYED_SETTLE: &str = "umbp.get.keyed.settle";

/// A batch put chunk: its request sent, the holder's answer read (the holder allocates every
/// slot), and its writes planned.
pub const PUT_KEYED_REPLY: &str = "umbp.put.keyed.reply";
/// A batch put chunk's writes, fanned out over the copy pool, each summed as it is written.
pub const PUT_KEYED_COPY: &str = "umbp.put.keyed.copy";
/// A batch put chunk copied while routed, waiting for the master's placement after its writes.
pub const PUT_KEYED_ROUTE_WAIT: &str = "umbp.put.keyed.route_wait";
/// A batch put chunk's settle frame and the holder's verdict (the holder commits what arrived).
pub const PUT_KEYED_COMMIT: &str = "umbp.put.keyed.commit";
