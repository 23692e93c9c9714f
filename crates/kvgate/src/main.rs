//! The `kvgate` binary: one executable, one subcommand per job.
//!
//! This file only parses the command line, sets up logging and the async runtime, and
//! hands each subcommand to the crate that owns it. It must not contain routing,
//! proxying, simulation or benchmarking logic of its own.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvgate",
    version,
    about = "KV-cache-aware request router for LLM inference fleets"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `kvgate_gateway=debug`.
    #[arg(
        long,
        global = true,
        env = "KVGATE_LOG",
        default_value = "info",
        help_heading = "Logging"
    )]
    log: String,
    /// Emit logs as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "KVGATE_LOG_JSON", help_heading = "Logging")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the OpenAI-compatible routing gateway in front of engine replicas.
    Serve(Box<kvgate_gateway::cli::ServeArgs>),
    /// Run as the Endpoint Picker of a Kubernetes Gateway API Inference Extension
    /// gateway (Envoy ext_proc): the gateway asks which endpoint serves each request.
    Epp(Box<kvgate_epp::cli::EppArgs>),
    /// Run one simulated vLLM-compatible engine (paged prefix cache, batching, KV events).
    MockEngine(kvgate_mock_engine::cli::MockEngineArgs),
    /// Replay a trace against an endpoint, or compare routers side by side.
    Bench(kvgate_bench::cli::BenchArgs),
    /// Start a simulated fleet and kvgate, and compare round_robin with kv_aware.
    Demo(kvgate_bench::cli::DemoArgs),
    /// Start simulated engines and a kv_aware gateway in front of them, print the URL
    /// and curl commands to try, and run until Ctrl-C.
    Up(kvgate_bench::up::UpArgs),
    /// Tokenize an OpenAI request body read from stdin, exactly as the engine would.
    Tokenize(kvgate_tokenize::cli::TokenizeArgs),
    /// Compare routing policies on a simulated fleet in virtual time (deterministic, no
    /// sockets, the real routing code); plan fleet size for a TTFT target.
    Simulate(kvgate_sim::cli::SimulateArgs),
}

fn init_logging(filter: &str, json: bool) {
    let env_filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: redirected logs stay plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let cli =
        Cli::try_parse().unwrap_or_else(|e| kvgate_gateway::cli::explain_removed_flag(e).exit());
    if !kvgate_core::cpu_can_hash_blocks() {
        eprintln!("{}", kvgate_core::CPU_CANNOT_HASH_BLOCKS);
        return ExitCode::FAILURE;
    }
    init_logging(&cli.log, cli.log_json);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("kvgate: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => kvgate_gateway::cli::run(*args).await,
            Command::Epp(args) => kvgate_epp::cli::run(*args).await,
            Command::MockEngine(args) => kvgate_mock_engine::cli::run(args).await,
            Command::Bench(args) => kvgate_bench::cli::run_bench(args).await,
            Command::Demo(args) => kvgate_bench::cli::run_demo(args).await,
            Command::Up(args) => kvgate_bench::up::run_up(args).await,
            Command::Tokenize(args) => kvgate_tokenize::cli::run(args).await,
            Command::Simulate(args) => kvgate_sim::cli::run(args),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvgate: {err:#}");
            ExitCode::FAILURE
        }
    }
}
