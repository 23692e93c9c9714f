//! Benchmark-only crate; see benches/index_compare.rs.
