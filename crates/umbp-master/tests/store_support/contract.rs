//! The `contract!` macro of the store contract suite (a file of its own so that test files with no
//! contract test do not define it unused). Include it with `#[macro_use] #[path] mod contract;`.

/// Runs each listed contract test (a `fn(Kind)`) against every store, as `in_memory::NAME`,
/// `on_redis::NAME` and `sharded::NAME` (three Redis shards).
macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod in_memory {
            $(#[test]
            fn $name() {
                super::$name(crate::store_support::Kind::Memory);
            })*
        }
        mod on_redis {
            $(#[test]
            fn $name() {
                super::$name(crate::store_support::Kind::Redis);
            })*
        }
        mod sharded {
            $(#[test]
            fn $name() {
                super::$name(crate::store_support::Kind::Sharded);
            })*
        }
    };
}
