//! A group setting made a gid: a name is looked up in the host's group database
//! ([`umbp_transfer::shm::group_id`]).

use super::tree::GroupSetting;

/// The gid `group` names on this host, or why there is none.
pub(crate) fn gid(group: &GroupSetting) -> Result<u32, String> {
    match group {
        GroupSetting::Id(gid) => Ok(*gid),
        GroupSetting::Name(name) => match umbp_transfer::shm::group_id(name) {
            Ok(Some(gid)) => Ok(gid),
            Ok(None) => Err(format!("no group {name:?} on this host (`getent group` lists them); give a gid instead")),
            Err(e) => Err(format!("looking up group {name:?}: {e}; give a gid instead")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gid_is_itself_and_a_name_is_looked_up() {
        assert_eq!(gid(&GroupSetting::Id(4242)), Ok(4242));
        assert_eq!(gid(&GroupSetting::Name("root".into())), Ok(0));
        let err = gid(&GroupSetting::Name("umbp-no-such-group-4f2a".into())).unwrap_err();
        assert!(err.contains("no group \"umbp-no-such-group-4f2a\""), "{err}");
    }

    #[test]
    fn digits_are_a_gid_and_anything_else_a_name() {
        assert_eq!(GroupSetting::parse("1000"), Ok(GroupSetting::Id(1000)));
        assert_eq!(GroupSetting::parse(" umbp "), Ok(GroupSetting::Name("umbp".into())));
        assert!(GroupSetting::parse("").is_err());
        assert!(GroupSetting::parse("99999999999").unwrap_err().contains("out of range"));
    }
}
