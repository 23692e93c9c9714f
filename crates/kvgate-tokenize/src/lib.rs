//! Placeholder: being built (see the issue tracker).
pub mod cli {
    /// Arguments (placeholder).
    #[derive(clap::Args, Debug)]
    pub struct TokenizeArgs {}
    /// Entry point (placeholder).
    pub async fn run(_args: TokenizeArgs) -> anyhow::Result<()> {
        anyhow::bail!("not built yet")
    }
}
