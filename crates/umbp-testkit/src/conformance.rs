//! The conformance suite of [`MediumBackend`](umbp_core::MediumBackend): every contract of the trait
//! (architecture §5), checked against any medium a factory builds.
//!
//! A medium proves itself with one test:
//!
//! ```
//! use std::sync::Arc;
//! use umbp_testkit::conformance::{self, Subject};
//! use umbp_testkit::{MockBackend, MockConfig};
//!
//! conformance::run(|env| {
//!     let config = MockConfig { clock: env.clock.clone(), pages: 8, ..MockConfig::default() };
//!     let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
//!     let mock = Arc::new(MockBackend::new(config));
//!     let reaper = Arc::clone(&mock);
//!     Subject {
//!         backend: mock,
//!         tick: Box::new(move || reaper.reaper_tick()),
//!         read_lease,
//!         pending_ttl,
//!         background_reaper: false,
//!     }
//! });
//! ```
//!
//! Each check gets fresh subjects and a fresh [`ManualClock`](umbp_core::ManualClock), runs under
//! [`catch_unwind`](std::panic::catch_unwind) so one failure never hides another, and always ends with
//! every subject shut down and checked for leftover registrations. Time moves only when a check
//! advances the clock, and expiry is observed after the subject's `tick`. A medium with a background
//! reaper may let it run against the same clock: every check holds whether a sweep happens on that
//! thread or in `tick`. Nothing sleeps, except the one check of a background reaper (see
//! [`Subject::background_reaper`](crate::conformance::Subject::background_reaper)), which polls it in
//! real time and is skipped for media without one.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{Clock, ManualClock, MediumBackend};

mod allocate;
mod commit;
mod concurrency;
mod events;
mod evict;
mod fixture;
mod lifecycle;
mod ranged;
mod release;

use fixture::Fixture;

/// What the suite hands the factory for each subject it builds.
#[derive(Debug, Clone)]
pub struct Env {
    /// The clock the subject must read for every TTL and lease. The suite creates a fresh one per
    /// check and moves it forward by hand; two subjects built for one check share it.
    pub clock: Arc<ManualClock>,
}

impl Env {
    /// The clock as the trait object media are configured with.
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.clock) as Arc<dyn Clock>
    }
}

/// A medium under test, as the factory returns it: **not** initialised (the suite calls `init` with a
/// [`LocalOnlyRegistrar`](crate::LocalOnlyRegistrar)).
pub struct Subject {
    /// The medium.
    pub backend: Arc<dyn MediumBackend>,
    /// Runs the medium's reaper sweep once, synchronously: frees expired pending slots, drops expired
    /// read leases and releases deferred frees, reading [`Env::clock`].
    pub tick: Box<dyn Fn() + Send + Sync>,
    /// The read-lease length the medium was configured with.
    pub read_lease: Duration,
    /// The pending-slot TTL the medium was configured with.
    pub pending_ttl: Duration,
    /// Whether the medium promises that `init` starts a reaper thread that sweeps on its own (without
    /// `tick`), reading [`Env::clock`] as often as it likes. When `true`, the check
    /// `background_reaper_sweeps_without_tick` waits (in real time, up to 3 s) for that thread to free
    /// an expired slot; when `false` that check is skipped and listed in [`Report::skipped`].
    pub background_reaper: bool,
}

impl fmt::Debug for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subject")
            .field("backend", &self.backend)
            .field("read_lease", &self.read_lease)
            .field("pending_ttl", &self.pending_ttl)
            .field("background_reaper", &self.background_reaper)
            .finish_non_exhaustive()
    }
}

/// The outcome of a suite run: every check by name, passed, failed with its message, or skipped
/// with the reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Checks that passed, in suite order.
    pub passed: Vec<&'static str>,
    /// Checks that failed, in suite order, each with what went wrong.
    pub failed: Vec<(&'static str, String)>,
    /// Checks that did not apply to the subject (an opt-in capability it does not claim), in suite
    /// order, each with why. A skipped check counts as neither passed nor failed.
    pub skipped: Vec<(&'static str, String)>,
}

impl Report {
    /// Whether every check passed.
    pub fn is_ok(&self) -> bool {
        self.failed.is_empty()
    }

    /// The names of the failed checks, in suite order.
    pub fn failed_names(&self) -> Vec<&'static str> {
        self.failed.iter().map(|(name, _)| *name).collect()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.passed.len() + self.failed.len();
        write!(f, "{} of {total} conformance checks passed", self.passed.len())?;
        if !self.skipped.is_empty() {
            write!(f, " ({} skipped)", self.skipped.len())?;
        }
        for (name, message) in &self.failed {
            write!(f, "\n  FAILED {name}: {}", message.replace('\n', "\n    "))?;
        }
        for (name, reason) in &self.skipped {
            write!(f, "\n  skipped {name}: {reason}")?;
        }
        Ok(())
    }
}

/// One named check of the suite.
pub struct Check {
    /// The check's name (its function name), stable across releases.
    pub name: &'static str,
    /// The contract it tests, in one line.
    pub contract: &'static str,
    body: fn(&Fixture<'_>),
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Check").field("name", &self.name).field("contract", &self.contract).finish_non_exhaustive()
    }
}

impl Check {
    /// Runs this check alone against media from `factory`: `Err` carries the failure message. A
    /// check that does not apply to the subject passes trivially; [`outcome`](Self::outcome) tells
    /// the two apart.
    pub fn run<F>(&self, factory: F) -> Result<(), String>
    where
        F: Fn(&Env) -> Subject,
    {
        match run_check(self, &factory) {
            Outcome::Passed | Outcome::Skipped(_) => Ok(()),
            Outcome::Failed(message) => Err(message),
        }
    }

    /// Runs this check alone against media from `factory` and says how it ended.
    pub fn outcome<F>(&self, factory: F) -> Outcome
    where
        F: Fn(&Env) -> Subject,
    {
        run_check(self, &factory)
    }
}

/// How one check ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// What went wrong.
    Failed(String),
    /// The check does not apply to the subject, and why.
    Skipped(String),
}

/// Runs every check against media built by `factory` and panics, listing every failed check by name
/// and message, if any fails.
///
/// # Requirements on the subject
/// - `factory` returns a fresh, un-initialised medium each call, configured to read [`Env::clock`]
///   for every TTL and lease, with `tick`, `read_lease` and `pending_ttl` describing it truthfully.
/// - After `init` its capacity is between 4 and 4096 pages (`capacity().total_bytes / page_size()`),
///   and it accepts a single value as large as its whole capacity.
/// - Its reaper may also run in the background, against the same clock; with
///   [`Subject::background_reaper`] set it must.
///
/// # Panics
/// When any check fails.
pub fn run<F>(factory: F)
where
    F: Fn(&Env) -> Subject,
{
    let report = run_report(factory);
    if !report.is_ok() {
        panic!("{report}");
    }
}

/// Runs every check against media built by `factory` and reports, without panicking. See [`run`]
/// for what the subject must satisfy.
///
/// For a suite of one's own around it, or to show that a broken medium fails exactly the checks it
/// should:
///
/// ```
/// use std::sync::Arc;
/// use umbp_testkit::conformance::{self, Subject};
/// use umbp_testkit::{MockBackend, MockConfig};
///
/// let report = conformance::run_report(|env| {
///     let config = MockConfig { clock: env.clock.clone(), pages: 8, ..MockConfig::default() };
///     let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
///     let mock = Arc::new(MockBackend::new(config));
///     let reaper = Arc::clone(&mock);
///     let tick = Box::new(move || reaper.reaper_tick());
///     Subject { backend: mock, tick, read_lease, pending_ttl, background_reaper: false }
/// });
/// assert!(report.is_ok(), "{report}");
/// assert_eq!(report.passed.len() + report.skipped.len(), conformance::checks().len());
/// ```
pub fn run_report<F>(factory: F) -> Report
where
    F: Fn(&Env) -> Subject,
{
    let mut report = Report::default();
    for check in checks() {
        match run_check(check, &factory) {
            Outcome::Passed => report.passed.push(check.name),
            Outcome::Failed(message) => report.failed.push((check.name, message)),
            Outcome::Skipped(reason) => report.skipped.push((check.name, reason)),
        }
    }
    report
}

/// Every check of the suite, in the order [`run`] runs them.
pub fn checks() -> &'static [Check] {
    CHECKS
}

fn run_check(check: &Check, factory: &dyn Fn(&Env) -> Subject) -> Outcome {
    let fixture = Fixture::new(factory);
    let outcome = catch_unwind(AssertUnwindSafe(|| (check.body)(&fixture)));
    // Shutdown and the leak check run whether the body passed or not.
    let leftovers = fixture.finish();
    let mut problems = Vec::new();
    if let Err(payload) = outcome {
        problems.push(fixture::panic_message(payload.as_ref()));
    }
    problems.extend(leftovers);
    if !problems.is_empty() {
        Outcome::Failed(problems.join("\n"))
    } else if let Some(reason) = fixture.skipped() {
        Outcome::Skipped(reason)
    } else {
        Outcome::Passed
    }
}

macro_rules! checks {
    ($($module:ident :: $name:ident => $contract:literal,)*) => {
        static CHECKS: &[Check] = &[$(Check { name: stringify!($name), contract: $contract, body: $module::$name },)*];
    };
}

checks! {
    lifecycle::subject_meets_suite_requirements => "a real tier, a name, a page size and 4..=4096 pages",
    lifecycle::before_init_publishes_nothing => "no buffer ref or descriptor before init",
    lifecycle::init_is_idempotent_and_registers_buffers => "init registers each buffer once; a second init does nothing",
    lifecycle::init_failure_is_reported_and_retryable => "a refused registration fails init, leaks nothing, may be retried",
    lifecycle::shutdown_deregisters_everything_and_is_idempotent => "shutdown deregisters every buffer; twice is a no-op",
    lifecycle::shutdown_without_init_is_harmless => "shutdown tolerates a missing init",
    lifecycle::shut_down_backend_refuses_init => "a shut-down medium refuses init",
    lifecycle::metric_samples_follow_the_naming_rule => "samples use generic umbp_backend_medium_* names, no tier/backend labels",
    allocate::empty_batches_return_empty => "every batch method answers an empty batch with an empty vector",
    allocate::zero_size_is_failed => "a 0-byte value is Failed and reserves nothing",
    allocate::key_larger_than_medium_is_failed_not_no_space => "a value larger than the medium is Failed, never FailedNoSpace",
    allocate::value_of_full_capacity_fits_an_empty_medium => "a value as large as the medium fits an empty medium",
    allocate::full_medium_reports_no_space_then_recovers_after_abort => "a full medium is FailedNoSpace until pages are freed",
    allocate::allocate_result_describes_its_pages => "an allocation reports its pages, size, page size, TTL and descriptors",
    allocate::batch_allocate_answers_positionally => "one allocate result per request, in request order",
    allocate::allocate_dedups_owned_key => "allocating an owned key is AlreadyExists and reserves nothing",
    allocate::pending_duplicates_are_allowed => "two pending slots for one key are allowed, with distinct ids",
    allocate::an_idle_medium_never_answers_allocate_busy => "with nothing in flight an allocation is a slot, a dedup or no space, never busy",
    commit::commit_makes_key_resolvable => "a commit makes the key resolvable and queues one Add",
    commit::commit_binds_the_commit_time_key => "the commit-time key is the one stored",
    commit::commit_race_first_wins => "two commits of one key: the first wins, the second frees its pages and succeeds",
    commit::commit_keeps_the_writers_checksum => "a checksum committed with a value comes back at every resolve; the winner's on a race",
    commit::commit_unknown_slot_fails => "commit of an unknown slot (incl. 0) fails",
    commit::commit_after_abort_fails => "commit of an aborted slot fails; slot ids are not reused",
    commit::commit_consumes_the_slot => "a slot commits once",
    commit::batch_commit_answers_positionally => "one commit result per request, in request order",
    commit::abort_is_idempotent => "abort reports true for every id, known or not, and never touches owned keys",
    commit::pending_slot_expires_after_ttl => "a pending slot lives its TTL, then is reaped silently",
    commit::commit_after_ttl_fails_without_a_tick => "a slot past its TTL never commits, swept or not; the failed commit frees its pages",
    commit::background_reaper_sweeps_without_tick => "a medium that claims a background reaper frees an expired slot without tick",
    evict::evict_results_one_per_key_in_order => "one evict result per key, in request order",
    evict::evict_unknown_is_zero_and_evict_is_idempotent => "evicting an unknown or freed key frees 0 bytes; one Remove",
    evict::evict_never_touches_pending_slots => "evict only frees owned keys",
    evict::read_lease_blocks_evict_until_expiry => "a resolve protects the key from evict until its lease ends",
    evict::resolve_renews_the_read_lease => "every resolve protects the key for a full lease",
    evict::resolve_miss_takes_no_lease => "a miss carries nothing and takes no lease",
    evict::batch_resolve_answers_positionally => "one resolve entry per key, in request order, descs only on request",
    events::events_follow_operation_order => "the outbox holds Add/Remove in operation order; failures queue nothing",
    events::snapshot_does_not_mutate_outbox => "snapshot_owned_keys lists owned keys and leaves the outbox alone",
    events::full_sync_snapshot_clears_outbox => "the full-sync snapshot lists owned keys and empties the outbox",
    events::clear_local_drops_keys_and_gates_allocation => "clear drops keys silently and gates allocation until acked",
    events::pre_clear_slot_cannot_commit => "a slot allocated before a clear never commits",
    events::clear_local_releases_leased_pages_by_lease_end => "a clear frees leased pages by the end of the lease",
    events::auto_flush_fires_once_at_threshold => "the hook fires once when the outbox reaches the threshold",
    events::auto_flush_rearms_after_full_sync_snapshot => "draining or a full-sync snapshot re-arms the hook",
    events::auto_flush_disabled_by_zero_and_none => "threshold 0 or no hook never fires; a new hook replaces the old",
    events::events_concatenate_across_media_in_one_stream => "drain/snapshot helpers concatenate media in list order",
    evict::capacity_accounting => "capacity drops at allocate, holds at commit, returns at evict and abort",
    evict::owned_key_count_tracks_commits_and_evicts => "owned_key_count counts committed, not evicted keys",
    allocate::pages_of_live_values_never_overlap => "no page is handed out twice",
    allocate::multi_page_values_round_trip_bookkeeping => "a multi-page value keeps distinct in-range pages through resolve",
    concurrency::concurrent_clients_keep_accounting_exact => "many threads at once: exact events, keys and capacity",
    concurrency::concurrent_commits_of_one_key_keep_one_value => "racing commits of one key keep one value and one Add",
    concurrency::full_sync_snapshot_is_atomic_under_concurrent_commits => "full syncs and drains racing writers rebuild exactly the owned set",
    concurrency::clear_local_races_no_new_owned_key_before_ack => "racing a clear, no allocation succeeds and no key is owned until the ack",
    release::release_ends_the_read_lease_at_once => "a hit names its lease; its release ends the lease with no time passing",
    release::two_readers_hold_one_lease_until_both_release => "leases are counted: the last reader's release ends them",
    release::a_release_of_an_ended_lease_changes_nothing => "a late, zero or foreign release never ends a live reader's lease",
    release::release_frees_a_cleared_keys_pages_at_once => "a key cleared under a reader gives its pages back at the release",
    release::an_idle_medium_never_answers_busy => "a miss is never busy; an idle medium serves what it owns",
    release::an_existence_check_holds_no_lease => "batch_contains answers ownership and leaves no lease behind",
    ranged::ranged_resolve_holds_every_asked_byte => "a ranged resolve's hit, whole or partial, holds every asked byte; a later whole resolve is whole",
}
