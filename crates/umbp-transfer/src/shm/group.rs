//! A group name made a gid, for [`ShmServerConfig::allowed_gid`](super::ShmServerConfig): looked up
//! in the host's group database (`getgrnam_r`), so NSS sources such as LDAP count, as they do for
//! `id` and `getent group`.

use std::ffi::CString;
use std::io;

/// The gid of the group named `name` on this host; `None` when there is no such group.
///
/// # Errors
/// The name has a NUL byte (`InvalidInput`), or the group database could not be read.
pub fn group_id(name: &str) -> io::Result<Option<u32>> {
    let c_name =
        CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the name"))?;
    // Most hosts' entries fit; grow on ERANGE (a group with many members listed).
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: `libc::group` is plain old data (integers and pointers); all-zero is a valid
        // value for `getgrnam_r` to overwrite.
        let mut group: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: a NUL-terminated name, a `group` to fill,
        // `buf` of `buf.len()` bytes for its strings, and `found`, set to `&group` or null. The
        // strings it points into are not read after `buf` changes.
        let rc = unsafe {
            libc::getgrnam_r(c_name.as_ptr(), &raw mut group, buf.as_mut_ptr().cast(), buf.len(), &raw mut found)
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(group.gr_gid)),
            libc::ERANGE if buf.len() < 1 << 24 => buf.resize(buf.len() * 4, 0),
            errno => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_looked_up_and_an_unknown_one_is_none() {
        // `root` is group 0 on every Linux host.
        assert_eq!(group_id("root").expect("lookup"), Some(0));
        assert_eq!(group_id("umbp-no-such-group-4f2a").expect("lookup"), None);
        assert_eq!(group_id("a\0b").expect_err("NUL").kind(), io::ErrorKind::InvalidInput);
    }
}
