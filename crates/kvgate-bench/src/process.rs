//! Child processes owned by the bench: spawned in their own process group, logged to
//! files, killed (whole group) on drop — even on error, panic or Ctrl-C — and killed by
//! the kernel if the bench itself dies (Linux parent-death signal).
//!
//! Owns process lifetime and readiness waiting. It must not know what the children are.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A running child process that is killed when dropped.
#[derive(Debug)]
pub struct ManagedChild {
    name: String,
    child: tokio::process::Child,
    pid: Option<u32>,
    stdout_log: PathBuf,
    stderr_log: PathBuf,
}

impl ManagedChild {
    /// Spawn `program args`, stdout and stderr to `<log_dir>/<name>.{out,err}.log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        log_dir: &Path,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("cannot create log dir {}", log_dir.display()))?;
        let stdout_log = log_dir.join(format!("{name}.out.log"));
        let stderr_log = log_dir.join(format!("{name}.err.log"));
        let out = std::fs::File::create(&stdout_log)
            .with_context(|| format!("cannot create {}", stdout_log.display()))?;
        let err = std::fs::File::create(&stderr_log)
            .with_context(|| format!("cannot create {}", stderr_log.display()))?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(true)
            .process_group(0);
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({})", program.display()))?;
        let pid = child.id();
        tracing::debug!(
            name,
            ?pid,
            "spawned {} {}",
            program.display(),
            args.join(" ")
        );
        Ok(Self {
            name: name.to_string(),
            child,
            pid,
            stdout_log,
            stderr_log,
        })
    }

    /// The child's process id, while it has not been killed.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Waits up to `timeout` for the child to exit on its own; true if it did.
    pub async fn wait_exit(&mut self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The child's name (used for its log files).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Fail with the log tail if the child has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            bail!(
                "{} exited ({status}) during startup; stderr tail:\n{}",
                self.name,
                self.log_tail(20)
            );
        }
        Ok(())
    }

    /// Wait until a stdout line starts with `prefix`.
    pub async fn wait_for_line(&mut self, prefix: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = std::fs::read_to_string(&self.stdout_log).unwrap_or_default();
            if text.lines().any(|l| l.trim_start().starts_with(prefix)) {
                return Ok(());
            }
            self.check_alive()?;
            if Instant::now() >= deadline {
                bail!(
                    "{} did not print {prefix:?} within {timeout:?}; stderr tail:\n{}",
                    self.name,
                    self.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until `GET` on any of `urls` answers with a success status.
    pub async fn wait_for_http(
        &mut self,
        urls: &[String],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()?;
        let deadline = Instant::now() + timeout;
        loop {
            for url in urls {
                if let Ok(resp) = http.get(url).send().await {
                    if resp.status().is_success() {
                        return Ok(());
                    }
                }
            }
            self.check_alive()?;
            if Instant::now() >= deadline {
                bail!(
                    "{} not ready at {} within {timeout:?}; stderr tail:\n{}",
                    self.name,
                    urls.join(" or "),
                    self.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last `n` lines of stderr (and stdout when stderr is empty).
    pub fn log_tail(&self, n: usize) -> String {
        let mut text = std::fs::read_to_string(&self.stderr_log).unwrap_or_default();
        if text.trim().is_empty() {
            text = std::fs::read_to_string(&self.stdout_log).unwrap_or_default();
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Sends `signal` to the child's process group.
    pub fn signal(&self, signal: i32) -> anyhow::Result<()> {
        let pid = self.pid.context("the child has been killed")?;
        let pgid = i32::try_from(pid).context("pid out of range")?;
        // SAFETY: plain syscall; the group id is our own child's (process_group(0)).
        if unsafe { libc::kill(-pgid, signal) } != 0 {
            bail!(
                "kill({pgid}, {signal}): {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    fn kill_group(&mut self) {
        if let Some(pid) = self.pid.take() {
            if let Ok(pgid) = i32::try_from(pid) {
                // SAFETY: plain syscall; the group id is our own child's (process_group(0)).
                unsafe {
                    libc::kill(-pgid, libc::SIGKILL);
                }
            }
        }
        let _ = self.child.start_kill();
    }

    /// Kill the child (and its process group) and reap it.
    pub async fn shutdown(mut self) {
        self.kill().await;
    }

    /// Kill the child (and its process group) with SIGKILL, as a crash would, and reap
    /// it; the handle stays, and dropping it later is harmless.
    pub async fn kill(&mut self) {
        self.kill_group();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}

impl Drop for ManagedChild {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// Reserve `n` distinct free loopback ports (held open together, then released), none
/// handed out before by this process: the caller binds them later (a process it
/// starts, maybe seconds later for a replica restarted on its port), and meanwhile
/// another caller in the same process (tests run in parallel threads) must not be given
/// the same port by the kernel.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    // Every listener is held until the end, so a skipped port is not offered again.
    let mut held = Vec::new();
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        anyhow::ensure!(held.len() < n + 4096, "cannot reserve {n} free ports");
        let listener = TcpListener::bind("127.0.0.1:0").context("cannot reserve a free port")?;
        let port = listener.local_addr()?.port();
        held.push(listener);
        if handed_out.insert(port) {
            ports.push(port);
        }
    }
    Ok(ports)
}

/// Find an executable on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_never_handed_out_twice() {
        let ports: Vec<u16> = (0..20).flat_map(|_| free_ports(8).unwrap()).collect();
        let set: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(
            set.len(),
            160,
            "released ports are free again, yet not reused"
        );
    }

    #[tokio::test]
    async fn child_is_killed_on_drop_and_ready_line_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let sh = which("sh").unwrap();
        let args = vec![
            "-c".to_string(),
            "echo 'mock-engine ready'; sleep 30".to_string(),
        ];
        let mut child = ManagedChild::spawn("t", &sh, &args, dir.path()).unwrap();
        child
            .wait_for_line("mock-engine ready", Duration::from_secs(10))
            .await
            .unwrap();
        let pid = child.pid.unwrap() as i32;
        drop(child);
        // The child is dead (gone, or a zombie awaiting the reaper).
        let mut gone = false;
        for _ in 0..100 {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .chars()
                .next();
            if stat.is_empty() || state == Some('Z') {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(gone);
    }

    #[tokio::test]
    async fn early_exit_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let sh = which("sh").unwrap();
        let args = vec!["-c".to_string(), "echo broken >&2; exit 3".to_string()];
        let mut child = ManagedChild::spawn("bad", &sh, &args, dir.path()).unwrap();
        let err = child
            .wait_for_line("ready", Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("broken"), "{err:#}");
    }
}
