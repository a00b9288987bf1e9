//! Registrars for tests: one that only records what it is given, one that refuses.

use std::collections::HashMap;

use parking_lot::Mutex;
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, RegistrationError, TransferRef};

/// A [`MemoryRegistrar`] with no transport behind it: every registration succeeds and returns
/// [`TransferRef::local`] of the region, and every call is recorded.
///
/// It is what a node without any data plane degrades to, and all a medium needs to be tested without
/// the transfer layer. Registrations are matched by their local region (pointer, length, location), so
/// a backend may deregister a [`truncated`](TransferRef::truncated) copy of the ref it was given.
#[derive(Debug, Default)]
pub struct LocalOnlyRegistrar {
    inner: Mutex<Record>,
}

#[derive(Debug, Default)]
struct Record {
    registers: usize,
    deregisters: usize,
    last_location: Option<MemoryLocation>,
    /// How many times each region is registered and not yet deregistered.
    live: HashMap<LocalRegion, usize>,
}

impl LocalOnlyRegistrar {
    /// A registrar that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many times [`register_memory`](MemoryRegistrar::register_memory) was called.
    pub fn register_count(&self) -> usize {
        self.inner.lock().registers
    }

    /// How many times [`deregister`](MemoryRegistrar::deregister) was called, including calls for refs
    /// this registrar never issued or already took back (which the contract makes no-ops).
    pub fn deregister_count(&self) -> usize {
        self.inner.lock().deregisters
    }

    /// Where the most recently registered region lives.
    pub fn last_location(&self) -> Option<MemoryLocation> {
        self.inner.lock().last_location
    }

    /// Registrations not yet undone: a deregister counts only for a ref this registrar issued, and
    /// only once per registration.
    pub fn live_registrations(&self) -> usize {
        self.inner.lock().live.values().sum()
    }

    /// Whether `region` is currently registered.
    pub fn is_registered(&self, region: &LocalRegion) -> bool {
        self.inner.lock().live.get(region).is_some_and(|n| *n > 0)
    }
}

impl MemoryRegistrar for LocalOnlyRegistrar {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        let mut rec = self.inner.lock();
        rec.registers += 1;
        rec.last_location = Some(region.location());
        *rec.live.entry(region).or_default() += 1;
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, r: &TransferRef) {
        let mut rec = self.inner.lock();
        rec.deregisters += 1;
        let Some(region) = r.local_region() else { return };
        if let Some(n) = rec.live.get_mut(region) {
            *n -= 1;
            if *n == 0 {
                rec.live.remove(region);
            }
        }
    }
}

/// A [`MemoryRegistrar`] that refuses registrations, for testing a medium's `init` failure path.
///
/// [`new`](Self::new) refuses every registration with [`RegistrationError::Refused`];
/// [`allowing`](Self::allowing) lets the first `n` through (recorded by an inner
/// [`LocalOnlyRegistrar`]) and refuses the rest, which exercises the unwinding of a partly registered
/// medium.
#[derive(Debug, Default)]
pub struct FailingRegistrar {
    allow: usize,
    refused: Mutex<usize>,
    accepted: LocalOnlyRegistrar,
}

impl FailingRegistrar {
    /// Refuses every registration.
    pub fn new() -> Self {
        Self::allowing(0)
    }

    /// Accepts the first `n` registrations, then refuses every other one.
    pub fn allowing(n: usize) -> Self {
        Self { allow: n, refused: Mutex::new(0), accepted: LocalOnlyRegistrar::new() }
    }

    /// How many registrations were refused.
    pub fn refused_count(&self) -> usize {
        *self.refused.lock()
    }

    /// The record of the registrations that were accepted, and of every deregistration.
    pub fn accepted(&self) -> &LocalOnlyRegistrar {
        &self.accepted
    }
}

impl MemoryRegistrar for FailingRegistrar {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        // Counts attempts, not successes, so a refused registration never turns into a later success.
        let mut refused = self.refused.lock();
        if self.accepted.register_count() + *refused < self.allow {
            return self.accepted.register_memory(region);
        }
        *refused += 1;
        Err(RegistrationError::Refused {
            transport: "FailingRegistrar".into(),
            reason: "refuses registrations on purpose".into(),
        })
    }

    fn deregister(&self, r: &TransferRef) {
        self.accepted.deregister(r);
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::NonNull;

    use super::*;

    fn region(buf: &mut [u8]) -> LocalRegion {
        // SAFETY: every test keeps `buf` alive for as long as it uses the region.
        unsafe { LocalRegion::new(NonNull::from(buf).cast(), 64, MemoryLocation::Host) }
    }

    #[test]
    fn counts_registrations_and_matches_deregistrations_by_region() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        let reg = LocalOnlyRegistrar::new();
        let ra = reg.register_memory(region(&mut a)).unwrap();
        let rb = reg.register_memory(region(&mut b)).unwrap();
        assert_eq!(ra.local_region(), Some(&region(&mut a)));
        assert_eq!((reg.register_count(), reg.live_registrations()), (2, 2));
        assert_eq!(reg.last_location(), Some(MemoryLocation::Host));

        reg.deregister(&ra.clone().truncated(32));
        reg.deregister(&ra);
        assert_eq!((reg.deregister_count(), reg.live_registrations()), (2, 1), "a second deregister is a no-op");
        assert!(!reg.is_registered(&region(&mut a)) && reg.is_registered(&region(&mut b)));
        reg.deregister(&rb);
        assert_eq!(reg.live_registrations(), 0);
    }

    #[test]
    fn failing_registrar_lets_the_first_n_through() {
        let mut a = [0u8; 64];
        let reg = FailingRegistrar::allowing(1);
        assert!(reg.register_memory(region(&mut a)).is_ok());
        assert!(matches!(reg.register_memory(region(&mut a)), Err(RegistrationError::Refused { .. })));
        assert!(reg.register_memory(region(&mut a)).is_err());
        assert_eq!((reg.accepted().live_registrations(), reg.refused_count()), (1, 2));
        assert!(FailingRegistrar::new().register_memory(region(&mut a)).is_err());
    }
}
