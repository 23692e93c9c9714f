pub mod mooncake;
