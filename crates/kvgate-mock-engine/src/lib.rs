//! Placeholder: being built (see the issue tracker).
pub mod cli {
    /// Arguments (placeholder).
    #[derive(clap::Args, Debug)]
    pub struct MockEngineArgs {}
    /// Entry point (placeholder).
    pub async fn run(_args: MockEngineArgs) -> anyhow::Result<()> {
        anyhow::bail!("not built yet")
    }
}
