//! Engine link watch: notices when an engine's PUB endpoint goes away.
//!
//! The `zeromq` crate's SUB socket neither reports a lost peer nor reconnects, so a
//! restarted engine would silently stop feeding the index. This module owns one extra
//! TCP connection per subscriber that performs the ZMTP 3.0 NULL handshake as a SUB
//! socket with *no* subscription (so the publisher sends it nothing) and then waits for
//! end-of-stream. When it ends, the subscriber knows the engine went away, purges the
//! worker's entries and reconnects. It must not carry event data or parse anything
//! beyond the greeting.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Parses `tcp://host:port` into `host:port` (IPv6 hosts keep their brackets).
pub fn tcp_address(endpoint: &str) -> io::Result<String> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("endpoint {endpoint:?} is not tcp://host:port"),
        )
    })?;
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(rest.to_owned())
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("endpoint {endpoint:?} is not tcp://host:port"),
        )),
    }
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // ZMTP 3.0
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn ready_command() -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"SUB");
    let mut frame = Vec::with_capacity(body.len() + 2);
    frame.push(0x04); // command, short
    frame.push(body.len() as u8);
    frame.extend_from_slice(&body);
    frame
}

/// A live, idle ZMTP connection to an engine's publisher.
#[derive(Debug)]
pub struct LinkWatch {
    stream: TcpStream,
}

impl LinkWatch {
    /// Connects to `endpoint` (`tcp://host:port`) and completes the greeting, within
    /// `timeout`.
    pub async fn connect(endpoint: &str, timeout: Duration) -> io::Result<LinkWatch> {
        let addr = tcp_address(endpoint)?;
        let fut = async {
            let mut stream = TcpStream::connect(addr.as_str()).await?;
            stream.set_nodelay(true)?;
            stream.write_all(&greeting()).await?;
            let mut peer = [0u8; 64];
            stream.read_exact(&mut peer).await?;
            if peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "peer is not a ZMTP 3 endpoint",
                ));
            }
            stream.write_all(&ready_command()).await?;
            Ok(LinkWatch { stream })
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "link handshake timed out"))?
    }

    /// Resolves when the engine closes the connection or it fails. Anything the peer
    /// sends (its READY command) is read and discarded.
    pub async fn closed(&mut self) -> io::Error {
        let mut buf = [0u8; 512];
        loop {
            match self.stream.read(&mut buf).await {
                Ok(0) => return io::Error::new(io::ErrorKind::UnexpectedEof, "engine closed"),
                Ok(_) => continue,
                Err(e) => return e,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_endpoints() {
        assert_eq!(
            tcp_address("tcp://127.0.0.1:5557").unwrap(),
            "127.0.0.1:5557"
        );
        assert_eq!(tcp_address("tcp://[::1]:5557").unwrap(), "[::1]:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
        assert!(tcp_address("tcp://host").is_err());
        assert!(tcp_address("tcp://host:notaport").is_err());
    }

    #[test]
    fn greeting_is_64_bytes_null_mechanism() {
        let g = greeting();
        assert_eq!(&g[12..16], b"NULL");
        assert_eq!(ready_command().len(), 2 + 25);
    }
}
