//! Placeholder: being built (see the issue tracker).
pub mod cli {
    /// Arguments (placeholder).
    #[derive(clap::Args, Debug)]
    pub struct ServeArgs {}
    /// Entry point (placeholder).
    pub async fn run(_args: ServeArgs) -> anyhow::Result<()> {
        anyhow::bail!("not built yet")
    }
}
