//! Shared code of the `aqueduct` command-line tools. The load tool lives in [`bench`].

pub mod bench;
