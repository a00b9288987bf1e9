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
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, ManualClock, MediumBackend};
//! use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};
//!
//! // A medium for a test of something built on one, with time under the test's control.
//! let clock = ManualClock::new();
//! let mock = MockBackend::new(MockConfig { clock: clock.clone(), pages: 4, ..MockConfig::default() });
//! let registrar = Arc::new(LocalOnlyRegistrar::new());
//! mock.init(registrar.clone()).expect("init");
//! assert_eq!(registrar.live_registrations(), 1, "its one buffer");
//!
//! // A slot nobody commits is freed once its TTL passes and the reaper runs.
//! let slot = mock.batch_allocate(&[AllocateRequest::new("k", 4096)]).remove(0);
//! assert_eq!(slot.outcome, AllocateOutcome::Allocated);
//! clock.advance(Duration::from_secs(31));
//! mock.reaper_tick();
//! assert!(!mock.batch_commit(&[CommitRequest::new(slot.slot_id, "k")])[0].success);
//! assert_eq!(mock.calls().batch_commit, 1);
//! mock.shutdown();
//! assert_eq!(registrar.live_registrations(), 0, "shutdown deregisters");
//! ```
//!
//! # Owns
//! The fake medium, the test registrars and the suite's checks and their names.
//!
//! # Never
//! Depends on a concrete medium crate (media depend on this crate for their conformance tests, never
//! the other way round) or moves bytes. Never sleeps, save in the one opt-in check of a background
//! reaper thread (`background_reaper_sweeps_without_tick`, which only that thread can pass): the
//! suite drives time with [`ManualClock`](umbp_core::ManualClock) and each subject's reaper `tick`.

pub mod fuzz;
mod mock;
mod registrar;
pub mod require;

/// The conformance suite, public as a module so media call `conformance::run`.
pub mod conformance;

pub use mock::{MockBackend, MockCalls, MockConfig};
pub use registrar::{FailingRegistrar, LocalOnlyRegistrar};
