//! Placeholder: being built (see the issue tracker).
pub mod cli {
    /// Arguments (placeholder).
    #[derive(clap::Args, Debug)]
    pub struct BenchArgs {}
    /// Arguments (placeholder).
    #[derive(clap::Args, Debug)]
    pub struct DemoArgs {}
    /// Entry point (placeholder).
    pub async fn run_bench(_args: BenchArgs) -> anyhow::Result<()> {
        anyhow::bail!("not built yet")
    }
    /// Entry point (placeholder).
    pub async fn run_demo(_args: DemoArgs) -> anyhow::Result<()> {
        anyhow::bail!("not built yet")
    }
}
