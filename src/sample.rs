//! Next-token choice from logits: a seeded sampler chain.
//!
//! [`Sampler`] applies, in this order (the order of Hugging Face's logits processors):
//! 1. repetition penalty over the last `repetition_window` tokens: CTRL's penalized
//!    sampling (Keskar et al. 2019) divides a recent token's logit by `θ`; as in common
//!    implementations, a negative logit is multiplied by `θ` instead, so `θ > 1` always
//!    lowers it. Each distinct recent token is penalised once;
//! 2. temperature 0 → greedy: the argmax of the penalised logits, lowest id on ties;
//! 3. temperature `T > 0`: `p_i ∝ exp((x_i − max x) / T)`, computed in f64;
//! 4. top-k: keep the `k` most probable tokens (ties broken by lower id);
//! 5. top-p (nucleus, Holtzman et al. 2020): in order of decreasing probability (lower id
//!    first on ties), keep the shortest prefix whose renormalised mass is `≥ top_p`;
//! 6. min-p: keep tokens with `p_i ≥ min_p · max_j p_j`;
//! 7. draw one token from the kept set, renormalised, with the seeded [`Rng`].
//!
//! Every filter keeps at least the most probable token, so a draw always has a candidate.

use crate::error::{Error, Result};
use std::cmp::Ordering;
use std::collections::VecDeque;

/// A small seeded generator (SplitMix64): reproducible streams from a `u64` seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose sequence depends only on `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Parameters of the sampler chain. The defaults sample from `softmax(logits)` unfiltered.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// `T ≥ 0`; 0 is greedy decoding.
    pub temperature: f32,
    /// Keep the `k` most probable tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus mass in `(0, 1]`; 1 = off.
    pub top_p: f32,
    /// Relative probability floor in `[0, 1]`; 0 = off.
    pub min_p: f32,
    /// Penalty `θ > 0` on recently seen tokens; 1 = off.
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the penalty looks at; 0 = off.
    pub repetition_window: usize,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_window: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding (temperature 0, no penalty).
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        }
    }

    /// Checks every field; the error names the field and the accepted range.
    pub fn validate(&self) -> Result<()> {
        fn check(ok: bool, field: &str, value: f32, range: &str) -> Result<()> {
            if ok {
                Ok(())
            } else {
                Err(Error::invalid(format!(
                    "sampler: {field} = {value} is outside {range}"
                )))
            }
        }
        let t = self.temperature;
        check(t.is_finite() && t >= 0.0, "temperature", t, "[0, inf)")?;
        let p = self.top_p;
        check(p > 0.0 && p <= 1.0, "top_p", p, "(0, 1]")?;
        let m = self.min_p;
        check((0.0..=1.0).contains(&m), "min_p", m, "[0, 1]")?;
        let r = self.repetition_penalty;
        check(
            r.is_finite() && r > 0.0,
            "repetition_penalty",
            r,
            "(0, inf)",
        )
    }
}

/// A sampler chain: its configuration, its generator and the window of recent tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
    recent: VecDeque<u32>,
    /// Scratch: penalised logits (f64).
    x: Vec<f64>,
    /// Scratch: unnormalised probabilities `exp((x_i − max x) / T)` of the candidates.
    w: Vec<f64>,
    /// Scratch: candidate ids.
    cand: Vec<u32>,
}

/// Total order "more probable first": larger logit, then lower id.
fn before(x: &[f64], a: u32, b: u32) -> Ordering {
    x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b))
}

impl Sampler {
    /// A sampler with a validated `config`, its generator seeded with `config.seed`.
    pub fn new(config: SamplerConfig) -> Result<Sampler> {
        config.validate()?;
        Ok(Sampler {
            rng: Rng::new(config.seed),
            recent: VecDeque::new(),
            x: Vec::new(),
            w: Vec::new(),
            cand: Vec::new(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Records tokens of the context (the prompt, or tokens chosen elsewhere) in the
    /// repetition window. [`Sampler::sample`] records its own choices.
    pub fn accept(&mut self, tokens: &[u32]) {
        let n = self.config.repetition_window;
        if n == 0 {
            return;
        }
        let tail = &tokens[tokens.len().saturating_sub(n)..];
        for &t in tail {
            if self.recent.len() == n {
                self.recent.pop_front();
            }
            self.recent.push_back(t);
        }
    }

    /// Forgets the recent tokens and reseeds the generator with `config.seed`.
    pub fn reset(&mut self) {
        self.recent.clear();
        self.rng = Rng::new(self.config.seed);
    }

    /// Picks the next token from `logits` (one per vocabulary id) and records it in the
    /// repetition window. Draws exactly one number from the generator when `T > 0`.
    ///
    /// Errors: empty or non-finite logits, a recent token outside `0..logits.len()`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let id = self.choose(logits)?;
        self.accept(&[id]);
        Ok(id)
    }

    fn choose(&mut self, logits: &[f32]) -> Result<u32> {
        self.candidates(logits)?;
        if self.config.temperature == 0.0 {
            return Ok(self.cand[0]);
        }
        let (w, cand) = (&self.w, &self.cand);
        let total: f64 = cand.iter().map(|&i| w[i as usize]).sum();
        let mut r = self.rng.next_f64() * total;
        for &i in cand {
            if r < w[i as usize] {
                return Ok(i);
            }
            r -= w[i as usize];
        }
        // Rounding left r ≥ 0 past the last weight: the last candidate with weight > 0.
        Ok(*cand
            .iter()
            .rev()
            .find(|&&i| w[i as usize] > 0.0)
            .unwrap_or(&cand[0]))
    }

    /// Fills `self.x` with the penalised logits and `self.cand` with the ids that survive the
    /// filters: greedy, the argmax alone (lowest id on ties); otherwise, with their weights in
    /// `self.w`, most probable first under top-p and in id order without top-k or top-p (so a
    /// draw walks the ids in order, as [`sample`] always has).
    fn candidates(&mut self, logits: &[f32]) -> Result<()> {
        if logits.is_empty() {
            return Err(Error::invalid("sampler: empty logits"));
        }
        if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(format!(
                "sampler: logit {i} is {} (must be finite)",
                logits[i]
            )));
        }
        let n = logits.len();
        self.x.clear();
        self.x.extend(logits.iter().map(|&v| f64::from(v)));
        self.apply_penalty(n)?;
        let x = &self.x;
        let c = &self.config;
        self.cand.clear();
        if c.temperature == 0.0 {
            let best = (1..n as u32).fold(0u32, |b, i| {
                if before(x, i, b) == Ordering::Less {
                    i
                } else {
                    b
                }
            });
            self.cand.push(best);
            return Ok(());
        }
        self.cand.extend(0..n as u32);
        if c.top_k > 0 && c.top_k < n {
            self.cand
                .select_nth_unstable_by(c.top_k - 1, |&a, &b| before(x, a, b));
            self.cand.truncate(c.top_k);
        }
        let top = self
            .cand
            .iter()
            .map(|&i| x[i as usize])
            .fold(f64::NEG_INFINITY, f64::max);
        let inv_t = 1.0 / f64::from(c.temperature);
        self.w.resize(n, 0.0);
        for &i in &self.cand {
            self.w[i as usize] = ((x[i as usize] - top) * inv_t).exp();
        }
        let w = &self.w;
        // Mass of the top-k set (the top-p denominator), then the min-p cut, which keeps a
        // prefix of the sorted order and so may be applied before sorting.
        let mass: f64 = self.cand.iter().map(|&i| w[i as usize]).sum();
        if c.min_p > 0.0 {
            let floor = f64::from(c.min_p);
            self.cand.retain(|&i| w[i as usize] >= floor);
        }
        if c.top_p < 1.0 {
            self.cand.sort_unstable_by(|&a, &b| before(x, a, b));
            let target = f64::from(c.top_p) * mass;
            let mut cum = 0.0;
            let mut keep = self.cand.len();
            for (j, &i) in self.cand.iter().enumerate() {
                cum += w[i as usize];
                if cum >= target {
                    keep = j + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        Ok(())
    }

    fn apply_penalty(&mut self, n: usize) -> Result<()> {
        let theta = f64::from(self.config.repetition_penalty);
        if theta == 1.0 || self.recent.is_empty() {
            return Ok(());
        }
        let mut seen: Vec<u32> = self.recent.iter().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            let v = self.x.get_mut(t as usize).ok_or_else(|| {
                Error::invalid(format!(
                    "sampler: recent token {t} is outside the {n} logits"
                ))
            })?;
            *v = if *v > 0.0 { *v / theta } else { *v * theta };
        }
        Ok(())
    }

    /// The probabilities the next [`Sampler::sample`] would draw from (index = token id,
    /// zero for filtered tokens; greedy puts 1 on the argmax). Leaves the generator and the
    /// window unchanged.
    pub fn probabilities(&mut self, logits: &[f32]) -> Result<Vec<f64>> {
        self.candidates(logits)?;
        let mut p = vec![0.0; logits.len()];
        if self.config.temperature == 0.0 {
            p[self.cand[0] as usize] = 1.0;
            return Ok(p);
        }
        let mut total = 0.0;
        for &i in &self.cand {
            p[i as usize] = self.w[i as usize];
            total += self.w[i as usize];
        }
        p.iter_mut().for_each(|v| *v /= total);
        Ok(p)
    }
}

/// Picks a token: `temperature == 0` → argmax (lowest id on ties); otherwise samples from
/// `softmax(logits / temperature)` with `rng`. The chain without filters, for callers that
/// keep their own generator.
///
/// Errors: empty logits, a negative or non-finite temperature, or non-finite logits.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> Result<u32> {
    let mut s = Sampler::new(SamplerConfig {
        temperature,
        repetition_window: 0,
        ..SamplerConfig::default()
    })?;
    std::mem::swap(&mut s.rng, rng);
    let r = s.choose(logits);
    std::mem::swap(&mut s.rng, rng);
    r
}

#[cfg(test)]
#[path = "sample_tests.rs"]
mod tests;
