//! `kvgate serve` as a standalone example binary (same flags), so the gateway can be
//! benchmarked while other crates of the workspace are being built.
//!
//! Usage: `cargo run --release -p kvgate-gateway --example serve -- --model m --worker URL ...`
//! Set `KVGATE_THREADS` to bound the runtime's worker threads.

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    serve: kvgate_gateway::cli::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = std::env::var("KVGATE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        rt.worker_threads(n);
    }
    rt.enable_all()
        .build()?
        .block_on(kvgate_gateway::cli::run(args.serve))
}
