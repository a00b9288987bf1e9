//! The open-file limit a data server needs.
//!
//! Every connection costs descriptors: one while it is in the handshake, three once it is served
//! (the socket and two handles to it). At its default caps a data server may hold about
//! 256 + 3 × 1024 of them, more than the soft `RLIMIT_NOFILE` many systems start processes with
//! (1024), while the hard limit is usually far higher. A node process calls
//! [`raise_open_file_limit`] once at start; without it, a server out of descriptors still closes
//! the oldest pending handshake (or the connection idle longest) to accept a new peer, but serves
//! fewer connections than its caps allow.

use std::io;

/// Raises this process's soft open-file limit (`RLIMIT_NOFILE`) to its hard limit, and returns the
/// soft limit now in force (`u64::MAX` when unlimited). A soft limit already at the hard limit is
/// left alone.
///
/// # Errors
/// The kernel refused the new limit (it should not: raising the soft limit up to the hard limit
/// needs no privilege). The limit is unchanged then; the caller may go on with it.
pub fn raise_open_file_limit() -> io::Result<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        return Ok(limit.current.unwrap_or(u64::MAX));
    }
    setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum })?;
    Ok(limit.maximum.unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_limit() {
        let raised = raise_open_file_limit().expect("raising up to the hard limit needs no privilege");
        let now = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(now.current, now.maximum);
        assert_eq!(raised, now.current.unwrap_or(u64::MAX));
        assert_eq!(raise_open_file_limit().expect("again"), raised, "idempotent");
    }
}
