//! Built-in synthetic workloads: shared-prefix (herding test), multi-turn, tool-agent,
//! no-sharing.
//!
//! Owns the generators that turn a few parameters into a deterministic list of
//! `Request`s with Poisson arrivals, the same type a trace produces. It must not send
//! requests or measure anything.

use std::time::Duration;

use crate::request::Request;
use crate::rng::SplitMix64;

/// Which synthetic workload to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Many users share one long system prompt, each adds a short distinct suffix.
    SharedPrefix,
    /// Conversations whose prompt grows turn by turn (previous turns are a prefix).
    MultiTurn,
    /// Agent episodes (--users): a tool suite's long system prompt (one of --groups), a
    /// task, then steps that each append the model's tool call and the tool's result,
    /// arriving after the tool's latency (--think-time). Short outputs, fast-growing
    /// prompts.
    ToolAgent,
    /// Every prompt is distinct: no prefix reuse at all.
    NoSharing,
}

impl WorkloadKind {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::ToolAgent => "tool-agent",
            WorkloadKind::NoSharing => "no-sharing",
        }
    }
}

/// Parameters of a synthetic workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadConfig {
    /// Which workload.
    pub kind: WorkloadKind,
    /// Number of requests.
    pub requests: usize,
    /// Mean arrival rate in requests per second (Poisson process).
    pub rate: f64,
    /// Shared system-prompt length (shared-prefix, multi-turn) or prompt length (no-sharing).
    pub prefix_tokens: usize,
    /// Distinct suffix per request (shared-prefix) or per user turn (multi-turn).
    pub suffix_tokens: usize,
    /// `max_tokens` per request (also the length of a synthesized assistant turn).
    pub output_tokens: u32,
    /// Number of distinct system prompts (shared-prefix) — 1 is the herding test.
    pub groups: usize,
    /// Number of users (shared-prefix session ids) or conversations (multi-turn).
    pub users: usize,
    /// Mean think time between turns of one conversation, in seconds (multi-turn).
    pub think_time_s: f64,
    /// Seed for arrivals and token content.
    pub seed: u64,
    /// Token ids are drawn from `[token_base, token_base + vocab_size)`.
    pub vocab_size: u32,
    /// Lowest token id.
    pub token_base: u32,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            kind: WorkloadKind::SharedPrefix,
            requests: 200,
            rate: 10.0,
            prefix_tokens: 2048,
            suffix_tokens: 128,
            output_tokens: 64,
            groups: 1,
            users: 32,
            think_time_s: 2.0,
            seed: 0,
            vocab_size: 32_000,
            token_base: 100,
        }
    }
}

// Key namespaces so different kinds of content never collide.
const NS_SYSTEM: u64 = 1;
const NS_SUFFIX: u64 = 2;
const NS_USER_TURN: u64 = 3;
const NS_ASSISTANT_TURN: u64 = 4;
const NS_UNIQUE: u64 = 5;
const NS_ARRIVALS: u64 = 6;
const NS_USERS: u64 = 7;

impl WorkloadConfig {
    fn tokens(&self, ns: u64, a: u64, b: u64, len: usize) -> Vec<u32> {
        let key = ns
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(17)
            .wrapping_add(a.wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
            .rotate_left(23)
            .wrapping_add(b.wrapping_mul(0x1656_67B1_9E37_79F9));
        let mut rng = SplitMix64::keyed(self.seed, key);
        let vocab = u64::from(self.vocab_size.max(1));
        (0..len)
            .map(|_| self.token_base.saturating_add(rng.below(vocab) as u32))
            .collect()
    }

    /// Poisson arrival offsets for `n` events at `rate` per second.
    fn arrivals(&self, n: usize, stream: u64) -> Vec<Duration> {
        let mut rng = SplitMix64::keyed(self.seed, NS_ARRIVALS ^ (stream << 8));
        let mean = if self.rate > 0.0 && self.rate.is_finite() {
            1.0 / self.rate
        } else {
            0.0
        };
        let mut t = 0.0f64;
        (0..n)
            .map(|i| {
                if i > 0 {
                    t += rng.exponential(mean);
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }

    /// Generate the workload's requests, sorted by arrival, ids 0..n.
    pub fn generate(&self) -> Vec<Request> {
        let mut reqs = match self.kind {
            WorkloadKind::SharedPrefix => self.shared_prefix(),
            WorkloadKind::MultiTurn => self.multi_turn(),
            WorkloadKind::ToolAgent => self.tool_agent(),
            WorkloadKind::NoSharing => self.no_sharing(),
        };
        reqs.sort_by_key(|r| (r.arrival, r.id));
        for (i, r) in reqs.iter_mut().enumerate() {
            r.id = i as u64;
        }
        reqs
    }

    fn shared_prefix(&self) -> Vec<Request> {
        let groups = self.groups.max(1) as u64;
        let users = self.users.max(1) as u64;
        let systems: Vec<Vec<u32>> = (0..groups)
            .map(|g| self.tokens(NS_SYSTEM, g, 0, self.prefix_tokens))
            .collect();
        let arrivals = self.arrivals(self.requests, 0);
        // Users arrive in random order (seeded): a fixed rotation of users would line up
        // with round_robin's rotation and hand it a perfectly cache-affine placement.
        let mut who = SplitMix64::keyed(self.seed, NS_USERS);
        arrivals
            .into_iter()
            .enumerate()
            .map(|(i, arrival)| {
                let i = i as u64;
                let user = who.below(users);
                let group = (user % groups) as usize;
                let mut prompt = systems[group].clone();
                prompt.extend(self.tokens(NS_SUFFIX, i, 0, self.suffix_tokens.max(1)));
                Request {
                    id: i,
                    arrival,
                    prompt,
                    max_tokens: self.output_tokens.max(1),
                    session_id: Some(format!("user-{user}")),
                    objective: Default::default(),
                }
            })
            .collect()
    }

    fn multi_turn(&self) -> Vec<Request> {
        let convs = self.users.max(1).min(self.requests.max(1));
        let turns = self.requests.div_ceil(convs).max(1);
        let starts = self.arrivals(convs, 1);
        let mut think = SplitMix64::keyed(self.seed, NS_ARRIVALS ^ 0xFFFF);
        let system = self.tokens(NS_SYSTEM, u64::MAX, 0, self.prefix_tokens);
        let mut out = Vec::with_capacity(convs * turns);
        for (c, start) in starts.into_iter().enumerate() {
            let c64 = c as u64;
            let mut history = system.clone();
            let mut at = start;
            for t in 0..turns {
                if out.len() >= self.requests {
                    break;
                }
                let t64 = t as u64;
                if t > 0 {
                    at += Duration::from_secs_f64(think.exponential(self.think_time_s.max(0.0)));
                }
                history.extend(self.tokens(NS_USER_TURN, c64, t64, self.suffix_tokens.max(1)));
                out.push(Request {
                    id: out.len() as u64,
                    arrival: at,
                    prompt: history.clone(),
                    max_tokens: self.output_tokens.max(1),
                    session_id: Some(format!("conv-{c}")),
                    objective: Default::default(),
                });
                history.extend(self.tokens(
                    NS_ASSISTANT_TURN,
                    c64,
                    t64,
                    self.output_tokens.max(1) as usize,
                ));
            }
        }
        out
    }

    fn tool_agent(&self) -> Vec<Request> {
        let episodes = self.users.max(1).min(self.requests.max(1));
        let steps = self.requests.div_ceil(episodes).max(1);
        let groups = self.groups.max(1) as u64;
        let suites: Vec<Vec<u32>> = (0..groups)
            .map(|g| self.tokens(NS_SYSTEM, g, 1, self.prefix_tokens))
            .collect();
        let starts = self.arrivals(episodes, 3);
        let mut latency = SplitMix64::keyed(self.seed, NS_ARRIVALS ^ 0x7001);
        let mut out = Vec::with_capacity(episodes * steps);
        for (e, start) in starts.into_iter().enumerate() {
            let e64 = e as u64;
            let mut context = suites[(e64 % groups) as usize].clone();
            // The task, then per step the tool's result.
            context.extend(self.tokens(NS_USER_TURN, e64, u64::MAX, self.suffix_tokens.max(1)));
            let mut at = start;
            for step in 0..steps {
                if out.len() >= self.requests {
                    break;
                }
                let s64 = step as u64;
                if step > 0 {
                    at += Duration::from_secs_f64(latency.exponential(self.think_time_s.max(0.0)));
                    context.extend(self.tokens(NS_SUFFIX, e64, s64, self.suffix_tokens.max(1)));
                }
                out.push(Request {
                    id: out.len() as u64,
                    arrival: at,
                    prompt: context.clone(),
                    max_tokens: self.output_tokens.max(1),
                    session_id: Some(format!("agent-{e}")),
                    objective: Default::default(),
                });
                // The tool call the model made.
                context.extend(self.tokens(
                    NS_ASSISTANT_TURN,
                    e64,
                    s64,
                    self.output_tokens.max(1) as usize,
                ));
            }
        }
        out
    }

    fn no_sharing(&self) -> Vec<Request> {
        let len = (self.prefix_tokens + self.suffix_tokens).max(1);
        self.arrivals(self.requests, 2)
            .into_iter()
            .enumerate()
            .map(|(i, arrival)| Request {
                id: i as u64,
                arrival,
                prompt: self.tokens(NS_UNIQUE, i as u64, 0, len),
                max_tokens: self.output_tokens.max(1),
                session_id: None,
                objective: Default::default(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kind: WorkloadKind) -> WorkloadConfig {
        WorkloadConfig {
            kind,
            requests: 40,
            prefix_tokens: 64,
            suffix_tokens: 8,
            output_tokens: 4,
            users: 5,
            ..WorkloadConfig::default()
        }
    }

    #[test]
    fn shared_prefix_shares_exactly_the_system_prompt() {
        let reqs = cfg(WorkloadKind::SharedPrefix).generate();
        assert_eq!(reqs.len(), 40);
        for r in &reqs {
            assert_eq!(r.prompt.len(), 72);
            assert_eq!(r.prompt[..64], reqs[0].prompt[..64]);
            assert!(r.session_id.is_some());
        }
        assert_ne!(reqs[0].prompt[64..], reqs[1].prompt[64..]);
    }

    #[test]
    fn tool_agent_steps_extend_their_episode_and_share_the_suite() {
        let reqs = WorkloadConfig {
            groups: 2,
            ..cfg(WorkloadKind::ToolAgent)
        }
        .generate();
        assert_eq!(reqs.len(), 40);
        let mut by_agent: std::collections::BTreeMap<&str, Vec<&Request>> = Default::default();
        for r in &reqs {
            by_agent
                .entry(r.session_id.as_deref().unwrap())
                .or_default()
                .push(r);
        }
        assert_eq!(by_agent.len(), 5);
        for steps in by_agent.values() {
            for w in steps.windows(2) {
                assert!(w[1].arrival >= w[0].arrival);
                // Each step's prompt: the previous one, its tool call (4) and the result (8).
                assert_eq!(w[1].prompt.len(), w[0].prompt.len() + 4 + 8);
                assert_eq!(w[1].prompt[..w[0].prompt.len()], w[0].prompt[..]);
            }
        }
        // Agents 0 and 2 use suite 0, agent 1 suite 1.
        let first = |a: &str| by_agent[a][0].prompt[..64].to_vec();
        assert_eq!(first("agent-0"), first("agent-2"));
        assert_ne!(first("agent-0"), first("agent-1"));
    }

    #[test]
    fn shared_prefix_groups_have_distinct_prompts() {
        let reqs = WorkloadConfig {
            groups: 2,
            ..cfg(WorkloadKind::SharedPrefix)
        }
        .generate();
        let distinct: std::collections::HashSet<_> =
            reqs.iter().map(|r| r.prompt[..64].to_vec()).collect();
        assert_eq!(distinct.len(), 2);
    }

    #[test]
    fn multi_turn_prompts_grow_and_extend_previous_turns() {
        let reqs = cfg(WorkloadKind::MultiTurn).generate();
        assert_eq!(reqs.len(), 40);
        let conv: Vec<_> = reqs
            .iter()
            .filter(|r| r.session_id.as_deref() == Some("conv-0"))
            .collect();
        assert_eq!(conv.len(), 8);
        for pair in conv.windows(2) {
            assert!(pair[1].arrival >= pair[0].arrival);
            assert!(pair[1].prompt.len() > pair[0].prompt.len());
            assert_eq!(pair[1].prompt[..pair[0].prompt.len()], pair[0].prompt[..]);
        }
    }

    #[test]
    fn no_sharing_prompts_are_distinct_from_the_first_token_on() {
        let reqs = cfg(WorkloadKind::NoSharing).generate();
        let firsts: std::collections::HashSet<_> =
            reqs.iter().map(|r| r.prompt[..4].to_vec()).collect();
        assert_eq!(firsts.len(), reqs.len());
    }

    #[test]
    fn generation_is_deterministic_and_sorted() {
        for kind in [
            WorkloadKind::SharedPrefix,
            WorkloadKind::MultiTurn,
            WorkloadKind::NoSharing,
        ] {
            let a = cfg(kind).generate();
            assert_eq!(a, cfg(kind).generate());
            assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            assert!(a.iter().enumerate().all(|(i, r)| r.id == i as u64));
        }
    }
}
