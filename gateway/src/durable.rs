//! Crash-safe small files (the API-key file, the node identity).
//!
//! A file is replaced by writing a temporary sibling, syncing it, renaming it
//! over the old name and syncing the directory, so a kill or power loss at
//! any point leaves either the old file or the new one, never a torn or
//! empty one. Writers that read-modify-write hold an advisory lock on a
//! sibling `.lock` file (flock: released by the kernel if the process dies).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The temporary sibling of `path` used while replacing it. One per process,
/// so two writers that do not share a lock cannot truncate each other's file.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp.{}", std::process::id()));
    path.with_file_name(name)
}

fn open_private(path: &Path, create_new: bool) -> std::io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.write(true);
    if create_new {
        opts.create_new(true);
    } else {
        opts.create(true).truncate(true);
    }
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    opts.open(path)
}

/// Syncs the directory holding `path`, so a rename or a new name in it
/// survives a power loss.
pub fn sync_dir_of(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Replaces `path` with `bytes` (mode 0600 on unix): temp file, fsync,
/// rename, directory fsync. On error the old file is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temp_path(path);
    let written = (|| {
        let mut f = open_private(&tmp, false)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    sync_dir_of(path)
}

/// Writes `path` only if no file of that name exists yet (the first of
/// concurrent creators wins; the others get `AlreadyExists`). The content is
/// complete and synced before the name appears, so a reader never sees an
/// empty file: temp file, fsync, hard link (fails if the name exists),
/// directory fsync.
pub fn create_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temp_path(path);
    let _ = std::fs::remove_file(&tmp);
    let linked = (|| {
        let mut f = open_private(&tmp, true)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        match std::fs::hard_link(&tmp, path) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists && !path.exists() => {
                // A file system without hard links: rename, the name was
                // free a moment ago (a racing creator may win instead;
                // either way the file is whole).
                tracing::debug!(error = %e, "no hard link; creating by rename");
                std::fs::rename(&tmp, path)
            }
            other => other,
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    linked?;
    sync_dir_of(path)
}

/// An exclusive advisory lock on `<path>.lock`, held until dropped.
#[derive(Debug)]
pub struct FileLock {
    file: File,
}

impl FileLock {
    /// Blocks until this process holds the lock for `path`.
    pub fn exclusive(path: &Path) -> std::io::Result<Self> {
        let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".lock");
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let file = opts.open(path.with_file_name(name))?;
        file.lock()?;
        Ok(Self { file })
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn write_atomic_replaces_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "leftover files: {names:?}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        write_atomic(&p, b"old").unwrap();
        // A directory where the temp file must go makes the write fail.
        std::fs::create_dir(temp_path(&p)).unwrap();
        assert!(write_atomic(&p, b"new").is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
    }

    #[test]
    fn create_atomic_never_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("id.key");
        create_atomic(&p, b"first").unwrap();
        let e = create_atomic(&p, b"second").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&p).unwrap(), b"first");
        assert!(!temp_path(&p).exists());
    }

    #[test]
    fn the_lock_excludes_a_second_holder_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        let held = FileLock::exclusive(&p).unwrap();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let p2 = p.clone();
        let t = std::thread::spawn(move || {
            let _l = FileLock::exclusive(&p2).unwrap();
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200)).is_err(),
            "lock not exclusive"
        );
        drop(held);
        rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
        t.join().unwrap();
    }
}
