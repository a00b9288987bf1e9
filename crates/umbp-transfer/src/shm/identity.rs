//! Which processes are "on the same host" for the shared-memory path.

use std::fmt;
use std::io;
use std::os::unix::fs::MetadataExt;

/// The identity two processes compare before sharing memory: the kernel's boot id (one kernel, one
/// boot: a memory file cannot cross either) and the network namespace (device and inode of
/// `/proc/self/ns/net`), because the server's socket lives in the abstract namespace of its network
/// namespace and a peer in another one cannot reach it — and containers that share a kernel but not
/// a network namespace are treated as different hosts, which is what an operator expects of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`, trimmed.
    pub boot_id: String,
    /// The device of the network namespace file.
    pub netns_dev: u64,
    /// The inode of the network namespace file.
    pub netns_ino: u64,
}

impl HostIdentity {
    /// This process's identity, or why it cannot be read (no `/proc`: then no shared path).
    pub fn current() -> io::Result<Self> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_owned();
        if boot_id.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty boot id"));
        }
        let netns = std::fs::metadata("/proc/self/ns/net")?;
        Ok(Self { boot_id, netns_dev: netns.dev(), netns_ino: netns.ino() })
    }

    /// Parses what [`Display`](fmt::Display) writes (`BOOT_ID/DEV/INO`), the form a node publishes.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split('/');
        let (Some(boot_id), Some(dev), Some(ino), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        if boot_id.is_empty() {
            return None;
        }
        Some(Self { boot_id: boot_id.to_owned(), netns_dev: dev.parse().ok()?, netns_ino: ino.parse().ok()? })
    }

    /// Whether a peer with identity `other` may use the shared path with this process.
    pub fn same_host(&self, other: &Self) -> bool {
        self == other
    }
}

impl fmt::Display for HostIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.boot_id, self.netns_dev, self.netns_ino)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_an_identity_that_round_trips() {
        let me = HostIdentity::current().expect("/proc is mounted here");
        assert_eq!(me.boot_id.len(), 36, "a UUID: {me}");
        assert!(me.same_host(&HostIdentity::current().expect("again")), "stable within a process");
        assert_eq!(HostIdentity::parse(&me.to_string()), Some(me.clone()));
        let rebooted = HostIdentity { boot_id: "00000000-0000-0000-0000-000000000000".into(), ..me.clone() };
        assert!(!me.same_host(&rebooted));
        let other_netns = HostIdentity { netns_ino: me.netns_ino + 1, ..me.clone() };
        assert!(!me.same_host(&other_netns));
    }

    #[test]
    fn malformed_identities_do_not_parse() {
        for text in ["", "abc", "abc/1", "abc/1/2/3", "/1/2", "abc/x/2", "abc/1/-2"] {
            assert_eq!(HostIdentity::parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_child_process_shares_the_identity() {
        // A child in the same namespaces reads the same boot id and namespace inode.
        let out = std::process::Command::new("stat")
            .args(["-L", "-c", "%d %i", "/proc/self/ns/net"])
            .output()
            .expect("stat runs");
        let text = String::from_utf8_lossy(&out.stdout);
        let me = HostIdentity::current().expect("identity");
        assert_eq!(text.trim(), format!("{} {}", me.netns_dev, me.netns_ino));
    }
}
