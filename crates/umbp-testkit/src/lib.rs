//! Test support for umbp-rs storage media: a working fake medium, registrars that need no transfer
//! layer, and the conformance suite every [`MediumBackend`](umbp_core::MediumBackend) must pass.
//!
//! - [`MockBackend`]: an honest medium over one heap buffer (real pages, slots, counted and
//!   releasable leases, dedup, clear gate, outbox, auto-flush), for tests of anything built on a
//!   medium; [`MockBackend::answer_busy`] makes it answer busy, as a staged medium out of pages does.
//! - [`LocalOnlyRegistrar`]: registers by handing back [`TransferRef::local`](umbp_core::TransferRef)
//!   and records every call; [`FailingRegistrar`] refuses, for `init` failure paths.
//! - [`conformance`]: `conformance::run(factory)` checks every contract of architecture §5 against
//!   any medium; a new medium proves itself by calling it from a test.
//!
//! # Owns
//! The fake medium, the test registrars and the suite's checks and their names.
//!
//! # Never
//! Depends on a concrete medium crate (media depend on this crate for their conformance tests, never
//! the other way round) or moves bytes. Never sleeps, save in the one opt-in check of a background
//! reaper thread (`background_reaper_sweeps_without_tick`, which only that thread can pass): the
//! suite drives time with [`ManualClock`](umbp_core::ManualClock) and each subject's reaper `tick`.

mod mock;
mod registrar;

/// The conformance suite, public as a module so media call `conformance::run`.
pub mod conformance;

pub use mock::{MockBackend, MockCalls, MockConfig};
pub use registrar::{FailingRegistrar, LocalOnlyRegistrar};
