//! Incremental parser for a `text/event-stream` body (OpenAI streaming responses).
//!
//! Owns only the framing: bytes in, complete `data:` payloads out. It must not
//! interpret the JSON inside events or touch timing.

/// Splits a byte stream into SSE `data:` payloads. Multi-line `data:` fields of one
/// event are joined with `\n`, as the SSE spec says; comments and other fields are ignored.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// A parser with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed bytes; returns the payloads of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.buf.drain(..=pos).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.line(&line, &mut events);
        }
        events
    }

    /// End of stream: returns an event left without its terminating blank line.
    pub fn finish(&mut self) -> Vec<String> {
        let mut events = Vec::new();
        if !self.buf.is_empty() {
            let line = std::mem::take(&mut self.buf);
            self.line(&line, &mut events);
        }
        if let Some(d) = self.data.take() {
            events.push(d);
        }
        events
    }

    fn line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(d) = self.data.take() {
                events.push(d);
            }
            return;
        }
        let text = String::from_utf8_lossy(line);
        if let Some(rest) = text.strip_prefix("data:") {
            let value = rest.strip_prefix(' ').unwrap_or(rest);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_across_chunk_boundaries() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert!(p.push(b":1}\n").is_empty());
        assert_eq!(p.push(b"\ndata: [DONE]\n\n"), vec!["{\"a\":1}", "[DONE]"]);
    }

    #[test]
    fn handles_crlf_comments_and_multiline_data() {
        let mut p = SseParser::new();
        let ev = p.push(b": keepalive\r\n\r\ndata: x\r\ndata: y\r\n\r\n");
        assert_eq!(ev, vec!["x\ny"]);
    }

    #[test]
    fn finish_flushes_an_unterminated_event() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: tail").is_empty());
        assert_eq!(p.finish(), vec!["tail"]);
    }
}
