//! The deterministic simulation core: requests, continuous batching, chunked prefill,
//! preemption, the virtual clock, and the KV events and token outputs of every step.
//!
//! Owns scheduling decisions only, modelled on vLLM v1's scheduler: each step first
//! schedules running requests (one decode token each, or the next prefill chunk) under
//! the token budget, preempting the most recently admitted request (recompute) when
//! blocks run out; then, if nothing was preempted, admits waiting requests in FIFO order
//! while blocks, budget and `max_num_seqs` allow. Full blocks are registered in the
//! prefix cache when they are scheduled (as vLLM does), so a later request in the same
//! step can already hit them. No I/O, no wall clock, no randomness beyond the seed:
//! the same config and the same calls give the same outputs.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::cache::{splitmix64, unit_draw, BlockId, EngineHasher, KvCache};
use crate::events::KvEvent;
use crate::latency::LatencyModel;

/// Identifier of a request inside one simulator (assigned in submission order).
pub type RequestId = u64;

/// Everything that shapes the simulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    pub block_size: u32,
    pub num_blocks: u32,
    pub max_num_seqs: u32,
    pub max_batched_tokens: u32,
    pub max_model_len: u32,
    /// Seeds the engine's block hashes and simulated EOS positions.
    pub seed: u64,
    pub latency: LatencyModel,
    /// Per-token probability of an early EOS for requests without `ignore_eos`
    /// (0 = always generate `max_tokens`).
    pub eos_probability: f64,
    /// Token ids emitted as generated output, cycled.
    pub output_tokens: Vec<u32>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 16384,
            // vLLM 0.32's `vllm serve` defaults on an H100, the GPU the latency model
            // was fitted on (1024 sequences, 8192 tokens a step; 256 and 2048 on
            // smaller GPUs, 128 and 2048 on CPUs).
            max_num_seqs: 1024,
            max_batched_tokens: 8192,
            max_model_len: 131072,
            seed: 0,
            latency: LatencyModel::default(),
            eos_probability: 0.0,
            output_tokens: crate::tokenizer::filler_token_ids(),
        }
    }
}

/// Why a configuration cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("output_tokens must not be empty")]
    NoOutputTokens,
}

impl SimConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_batched_tokens", self.max_batched_tokens),
            ("max_model_len", self.max_model_len),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.output_tokens.is_empty() {
            return Err(ConfigError::NoOutputTokens);
        }
        Ok(())
    }

    /// Longest sequence (prompt + output) a request may reach.
    pub fn max_sequence_len(&self) -> u64 {
        let cache_tokens = self.num_blocks as u64 * self.block_size as u64;
        cache_tokens.min(self.max_model_len as u64)
    }
}

/// A request as the core sees it: token ids in, a number of tokens out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    /// Leading prompt tokens whose KV arrives from a prefill engine (disaggregated
    /// serving): at admission they count as computed without prefill work, and their
    /// full blocks are stored (and published) as the engine's own.
    #[serde(default)]
    pub transferred_tokens: u32,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(
        "this model's maximum context length is {limit} tokens; the request has \
         {prompt} prompt tokens and asks for {max_tokens} output tokens"
    )]
    TooLong {
        prompt: usize,
        max_tokens: u32,
        limit: u64,
    },
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// Simulated end-of-sequence.
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// One generated token of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenOutput {
    pub id: RequestId,
    pub token: u32,
    /// 0-based position in the output.
    pub index: u32,
    pub prompt_tokens: u32,
    /// Prefix-cache hit (full blocks, in tokens) at the request's first admission.
    pub cached_tokens: u32,
    pub finished: Option<FinishReason>,
}

/// What one step did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepOutput {
    pub start_ms: f64,
    pub duration_ms: f64,
    pub events: Vec<KvEvent>,
    pub outputs: Vec<TokenOutput>,
    pub prefill_tokens: u64,
    pub decode_requests: u32,
    pub preempted: u32,
}

/// Counters over the simulator's lifetime (vLLM-style: queries and hits in tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SimCounters {
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub preemptions: u64,
    pub finished: u64,
    pub aborted: u64,
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt tokens computed by prefill (neither cached nor transferred).
    #[serde(default)]
    pub prefill_computed_tokens: u64,
    /// Prompt tokens whose KV arrived from a prefill engine.
    #[serde(default)]
    pub transferred_tokens: u64,
}

/// A point-in-time view for metrics and load probes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SimSnapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    /// The KV cache's size and block size (vLLM's `cache_config_info`).
    pub num_blocks: u32,
    pub block_size: u32,
    pub cached_blocks: usize,
    pub clock_ms: f64,
    pub counters: SimCounters,
}

#[derive(Debug)]
struct Req {
    tokens: Vec<u32>,
    prompt_len: usize,
    stop_at: u32,
    stop_reason: FinishReason,
    num_computed: usize,
    blocks: Vec<BlockId>,
    /// Engine hashes of the request's full blocks, chained (kept across preemption).
    hashes: Vec<u64>,
    /// Leading blocks already processed for caching (registered or duplicate).
    num_committed: usize,
    cached_tokens: Option<u32>,
    outputs: u32,
    /// Leading prompt tokens loaded from a prefill engine (see [`SimRequest`]).
    transferred_tokens: usize,
}

/// The simulated engine: a [`KvCache`] plus a vLLM-like scheduler and a virtual clock.
#[derive(Debug)]
pub struct Simulator {
    cfg: SimConfig,
    cache: KvCache,
    hasher: EngineHasher,
    requests: FxHashMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    next_id: RequestId,
    clock_ms: f64,
    counters: SimCounters,
    scheduled: Vec<(RequestId, usize)>,
}

impl Simulator {
    pub fn new(cfg: SimConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Self {
            cache: KvCache::new(cfg.num_blocks, cfg.block_size),
            hasher: EngineHasher::new(cfg.seed),
            requests: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            clock_ms: 0.0,
            counters: SimCounters::default(),
            scheduled: Vec::new(),
            cfg,
        })
    }

    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The virtual clock, in ms since the simulator started.
    pub fn clock_ms(&self) -> f64 {
        self.clock_ms
    }

    /// Move the virtual clock forward while idle (never backwards).
    pub fn advance_to(&mut self, ms: f64) {
        if ms > self.clock_ms {
            self.clock_ms = ms;
        }
    }

    /// True when there is nothing to run.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn snapshot(&self) -> SimSnapshot {
        SimSnapshot {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: self.cache.usage(),
            num_blocks: self.cfg.num_blocks,
            block_size: self.cfg.block_size,
            cached_blocks: self.cache.num_cached(),
            clock_ms: self.clock_ms,
            counters: self.counters,
        }
    }

    /// Queue a request. It is admitted by a later [`Simulator::step`].
    pub fn submit(&mut self, req: SimRequest) -> Result<RequestId, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(SubmitError::ZeroMaxTokens);
        }
        let limit = self.cfg.max_sequence_len();
        if req.prompt.len() as u64 + req.max_tokens as u64 > limit {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                limit,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let (stop_at, stop_reason) = self.stop_position(id, &req);
        let prompt_len = req.prompt.len();
        // At least one prompt token is computed here (the first output needs it).
        let transferred_tokens = (req.transferred_tokens as usize).min(prompt_len - 1);
        let mut tokens = req.prompt;
        tokens.reserve(req.max_tokens as usize);
        self.requests.insert(
            id,
            Req {
                tokens,
                prompt_len,
                stop_at,
                stop_reason,
                num_computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                num_committed: 0,
                cached_tokens: None,
                outputs: 0,
                transferred_tokens,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Drop a request wherever it is (client went away). Its blocks are released;
    /// blocks it already cached stay cached. Returns false for an unknown id.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(mut req) = self.requests.remove(&id) else {
            return false;
        };
        if let Some(pos) = self.running.iter().position(|&r| r == id) {
            self.running.remove(pos);
        } else if let Some(pos) = self.waiting.iter().position(|&r| r == id) {
            self.waiting.remove(pos);
        }
        free_blocks(&mut self.cache, &mut req);
        self.counters.aborted += 1;
        true
    }

    /// POST /reset_prefix_cache: refused (None) while requests hold blocks, unless
    /// `reset_running_requests` (vLLM's flag of the same name): then every running
    /// request is preempted first (back to the head of the queue, recomputed later).
    /// Returns the events to publish (one `AllBlocksCleared`).
    pub fn reset_prefix_cache(&mut self, reset_running_requests: bool) -> Option<Vec<KvEvent>> {
        if reset_running_requests {
            // Last admitted first, each to the queue's head: the queue keeps their order.
            while let Some(id) = self.running.pop() {
                self.preempt(id);
            }
        }
        let mut events = Vec::new();
        self.cache.reset(&mut events).then_some(events)
    }

    /// Full blocks of `prompt` the cache would serve right now, in tokens (read-only;
    /// uses the same rule as admission: at least one token is always computed).
    pub fn probe_prefix(&mut self, prompt: &[u32]) -> u32 {
        if prompt.is_empty() {
            return 0;
        }
        let bs = self.cfg.block_size as usize;
        let max_blocks = (prompt.len() - 1) / bs;
        let mut parent = None;
        let mut hit = 0;
        for chunk in prompt.chunks_exact(bs).take(max_blocks) {
            let h = self.hasher.block_hash(parent, chunk);
            if !self.cache.contains(h) {
                break;
            }
            parent = Some(h);
            hit += 1;
        }
        (hit * bs) as u32
    }

    /// Run one engine step at the current virtual time and advance the clock by its
    /// modelled duration. None when idle.
    pub fn step(&mut self) -> Option<StepOutput> {
        if self.is_idle() {
            return None;
        }
        let mut events = Vec::new();
        let preempted = self.schedule(&mut events);

        let mut prefill_tokens = 0u64;
        let mut decode_requests = 0u32;
        for &(id, num_new) in &self.scheduled {
            let Some(req) = self.requests.get(&id) else {
                continue;
            };
            if num_new == 1 && req.num_computed >= req.prompt_len {
                decode_requests += 1;
            } else {
                prefill_tokens += num_new as u64;
            }
        }
        self.counters.prefill_computed_tokens += prefill_tokens;
        let duration_ms =
            self.cfg
                .latency
                .step_ms(prefill_tokens, decode_requests > 0, self.cache.usage())
                * self.step_jitter_factor();
        let start_ms = self.clock_ms;
        self.clock_ms += duration_ms;
        self.counters.steps += 1;

        let mut outputs = Vec::new();
        let mut any_finished = false;
        for i in 0..self.scheduled.len() {
            let (id, num_new) = self.scheduled[i];
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            req.num_computed += num_new;
            if req.num_computed < req.tokens.len() {
                continue;
            }
            let out_tokens = &self.cfg.output_tokens;
            let token = out_tokens[req.outputs as usize % out_tokens.len()];
            let index = req.outputs;
            req.tokens.push(token);
            req.outputs += 1;
            self.counters.generation_tokens += 1;
            let finished = (req.outputs >= req.stop_at).then_some(req.stop_reason);
            outputs.push(TokenOutput {
                id,
                token,
                index,
                prompt_tokens: req.prompt_len as u32,
                cached_tokens: req.cached_tokens.unwrap_or(0),
                finished,
            });
            if finished.is_some() {
                any_finished = true;
                let mut req = match self.requests.remove(&id) {
                    Some(r) => r,
                    None => continue,
                };
                free_blocks(&mut self.cache, &mut req);
                self.counters.finished += 1;
            }
        }
        if any_finished {
            let requests = &self.requests;
            self.running.retain(|id| requests.contains_key(id));
        }
        Some(StepOutput {
            start_ms,
            duration_ms,
            events,
            outputs,
            prefill_tokens,
            decode_requests,
            preempted,
        })
    }

    /// Fill `self.scheduled` for this step; returns the number of preemptions.
    fn schedule(&mut self, events: &mut Vec<KvEvent>) -> u32 {
        self.scheduled.clear();
        let bs = self.cfg.block_size as usize;
        let mut budget = self.cfg.max_batched_tokens as usize;
        let mut preempted = 0u32;

        // 1. Running requests, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(req) = self.requests.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let num_new = (req.tokens.len() - req.num_computed).min(budget);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let need = blocks_needed(req.num_computed + num_new, bs, req.blocks.len());
            let mut self_preempted = false;
            while need > self.cache.num_free() {
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                preempted += 1;
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted || need > self.cache.num_free() {
                break;
            }
            self.grow(id, num_new, need, events);
            self.scheduled.push((id, num_new));
            budget -= num_new;
            i += 1;
        }

        // 2. Waiting requests, FIFO, only if nothing was preempted this step.
        if preempted == 0 {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs as usize {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                if !self.try_admit(id, &mut budget, events) {
                    break;
                }
                self.waiting.pop_front();
                self.running.push(id);
            }
        }
        preempted
    }

    /// Admit a waiting request if blocks allow: prefix-cache lookup, block allocation
    /// for its first chunk, registration of newly full blocks.
    fn try_admit(&mut self, id: RequestId, budget: &mut usize, events: &mut Vec<KvEvent>) -> bool {
        let bs = self.cfg.block_size as usize;
        let Some(req) = self.requests.get_mut(&id) else {
            // Unknown id in the queue: drop it from the queue by admitting nothing.
            return false;
        };
        let full = req.tokens.len() / bs;
        ensure_hashes(req, &mut self.hasher, bs, full);
        // vLLM always computes at least one token, so a fully cached prompt recomputes
        // its last block.
        let max_hit = (req.tokens.len() - 1) / bs;
        let mut hit = 0;
        let mut evictable = 0;
        while hit < max_hit {
            match self.cache.lookup(req.hashes[hit]) {
                Some(b) => {
                    if self.cache.is_free(b) {
                        evictable += 1;
                    }
                    hit += 1;
                }
                None => break,
            }
        }
        let hit_tokens = hit * bs;
        // Tokens whose KV was transferred in are computed already, at no cost.
        let start = hit_tokens.max(req.transferred_tokens);
        let num_new = (req.tokens.len() - start).min(*budget);
        let need = blocks_needed(start + num_new, bs, hit);
        if need + evictable > self.cache.num_free() {
            return false;
        }
        debug_assert!(req.blocks.is_empty());
        for k in 0..hit {
            if let Some(b) = self.cache.lookup(req.hashes[k]) {
                self.cache.acquire(b);
                req.blocks.push(b);
            }
        }
        req.num_computed = start;
        req.num_committed = hit;
        if req.cached_tokens.is_none() {
            req.cached_tokens = Some(hit_tokens as u32);
            self.counters.prompt_tokens += req.prompt_len as u64;
            self.counters.transferred_tokens += (start - hit_tokens) as u64;
        }
        self.counters.prefix_queries_tokens += req.tokens.len() as u64;
        self.counters.prefix_hits_tokens += hit_tokens as u64;
        self.grow(id, num_new, need, events);
        self.scheduled.push((id, num_new));
        *budget -= num_new;
        true
    }

    /// Allocate `need` new blocks for request `id` (caller checked they are free) and
    /// register the blocks that `num_new` more computed tokens make full.
    fn grow(&mut self, id: RequestId, num_new: usize, need: usize, events: &mut Vec<KvEvent>) {
        let bs = self.cfg.block_size as usize;
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        for _ in 0..need {
            match self.cache.allocate(events) {
                Some(b) => req.blocks.push(b),
                None => break,
            }
        }
        let full = ((req.num_computed + num_new) / bs).min(req.blocks.len());
        ensure_hashes(req, &mut self.hasher, bs, full);
        let block_size = self.cfg.block_size;
        let mut group: Option<(Vec<u64>, Option<u64>, Vec<u32>)> = None;
        for k in req.num_committed..full {
            let hash = req.hashes[k];
            let parent = if k == 0 {
                None
            } else {
                Some(req.hashes[k - 1])
            };
            let parent_cached = parent.is_none_or(|p| self.cache.contains(p));
            if parent_cached && self.cache.register(req.blocks[k], hash) {
                let tokens = &req.tokens[k * bs..(k + 1) * bs];
                match &mut group {
                    Some((hashes, _, toks)) => {
                        hashes.push(hash);
                        toks.extend_from_slice(tokens);
                    }
                    None => group = Some((vec![hash], parent, tokens.to_vec())),
                }
            } else if let Some((block_hashes, parent_block_hash, token_ids)) = group.take() {
                events.push(KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                });
            }
        }
        if let Some((block_hashes, parent_block_hash, token_ids)) = group {
            events.push(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            });
        }
        req.num_committed = req.num_committed.max(full);
    }

    fn preempt(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            free_blocks(&mut self.cache, req);
            req.num_computed = 0;
            req.num_committed = 0;
            self.waiting.push_front(id);
            self.counters.preemptions += 1;
        }
    }

    /// This step's jitter factor (1 without jitter): deterministic from (seed, step).
    fn step_jitter_factor(&self) -> f64 {
        let unit = |salt: u64| unit_draw(self.cfg.seed ^ splitmix64(self.counters.steps ^ salt));
        self.cfg
            .latency
            .jitter_factor(|| (unit(0x5a17_0001), unit(0x5a17_0002)))
    }

    fn stop_position(&self, id: RequestId, req: &SimRequest) -> (u32, FinishReason) {
        let p = self.cfg.eos_probability;
        if req.ignore_eos || p <= 0.0 {
            return (req.max_tokens, FinishReason::Length);
        }
        // Deterministic geometric draw from (seed, request id).
        let u = unit_draw(self.cfg.seed ^ splitmix64(id.wrapping_add(1)));
        let len = if p >= 1.0 {
            1.0
        } else {
            (u.ln() / (1.0 - p).ln()).ceil().max(1.0)
        };
        if len >= req.max_tokens as f64 {
            (req.max_tokens, FinishReason::Length)
        } else {
            (len as u32, FinishReason::Stop)
        }
    }
}

fn blocks_needed(tokens: usize, block_size: usize, held: usize) -> usize {
    tokens.div_ceil(block_size).saturating_sub(held)
}

fn ensure_hashes(req: &mut Req, hasher: &mut EngineHasher, bs: usize, upto: usize) {
    while req.hashes.len() < upto {
        let k = req.hashes.len();
        let parent = req.hashes.last().copied();
        let h = hasher.block_hash(parent, &req.tokens[k * bs..(k + 1) * bs]);
        req.hashes.push(h);
    }
}

/// Release a request's blocks tail first, so its last blocks are evicted first (as vLLM
/// frees them in reverse order).
fn free_blocks(cache: &mut KvCache, req: &mut Req) {
    for &b in req.blocks.iter().rev() {
        cache.release(b);
    }
    req.blocks.clear();
}
