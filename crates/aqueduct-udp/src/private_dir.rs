//! Where the broker and the `aqueduct` CLI keep their files when neither `AQUEDUCT_HOME` nor
//! `HOME` is set (a systemd system service without `User=` has neither): a directory of this
//! user's own in the temporary directory, `<temp>/aqueduct-<uid>`, not a file of a fixed name
//! there. Any local user can create a fixed name in `/tmp` first: a development certificate read
//! from such a file would have the CLI trust whoever wrote it, and one written to it by a broker
//! running as root would follow a link planted there.

use std::io;
use std::path::{Path, PathBuf};

/// `<temp>/aqueduct-<uid>` (`<temp>/aqueduct` off Unix). Not created: see [`ensure`] and
/// [`check`].
pub fn path() -> PathBuf {
    #[cfg(unix)]
    {
        std::env::temp_dir().join(format!("aqueduct-{}", uid()))
    }
    #[cfg(not(unix))]
    {
        std::env::temp_dir().join("aqueduct")
    }
}

/// Make [`path`] if it is missing (only this user may open it), then [`check`] it.
pub fn ensure(dir: &Path) -> io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    match builder.create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    check(dir)
}

/// What every refusal of [`check`] ends with: the way out that does not touch the directory.
const HINT: &str = "; or set AQUEDUCT_HOME to a directory of this user's own";

/// That `dir` is this user's own: a directory, not a link to one, owned by this user, that
/// no other user can open or write to.
pub fn check(dir: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory (a link or a file someone else made?){HINT}",
            dir.display()
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if meta.uid() != uid() {
            return Err(io::Error::other(format!(
                "{} belongs to another user (uid {}, this is {}): it is not this user's own \
                 directory{HINT}",
                dir.display(),
                meta.uid(),
                uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(io::Error::other(format!(
                "{} can be opened by other users (mode {:o}): make it 0700, or remove it{HINT}",
                dir.display(),
                meta.mode() & 0o777
            )));
        }
    }
    Ok(())
}

#[cfg(unix)]
#[allow(unsafe_code)]
fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_private_directory_of_ours_passes() {
        let base = std::env::temp_dir().join(format!("aqueduct-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).expect("base");
        let dir = base.join("mine");
        ensure(&dir).expect("made");
        let mode = std::fs::metadata(&dir).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        ensure(&dir).expect("already there, and ours");
        // Open to others: refused.
        let open = base.join("open");
        std::fs::create_dir(&open).expect("open");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = ensure(&open).expect_err("others can write to it");
        assert!(e.to_string().contains("mode 777"), "{e}");
        assert!(e.to_string().contains("set AQUEDUCT_HOME"), "{e}");
        // A link to a private directory: refused (the link itself could be anyone's).
        let link = base.join("link");
        std::os::unix::fs::symlink(&dir, &link).expect("link");
        let e = check(&link).expect_err("a link");
        assert!(e.to_string().contains("not a directory"), "{e}");
        assert!(e.to_string().contains("set AQUEDUCT_HOME"), "{e}");
        // Missing: check says so, and does not make it.
        assert!(check(&base.join("none")).is_err());
        assert!(path().starts_with(std::env::temp_dir()));
        let _ = std::fs::remove_dir_all(&base);
    }
}
