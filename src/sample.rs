//! Next-token choice from logits: greedy or temperature sampling with a seeded generator.

use crate::error::{Error, Result};

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

/// Picks a token: `temperature == 0` → argmax (lowest id on ties); otherwise samples from
/// `softmax(logits / temperature)`.
///
/// Errors: empty logits, a negative or non-finite temperature, or non-finite logits.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> Result<u32> {
    if logits.is_empty() {
        return Err(Error::invalid("sample: empty logits"));
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(Error::invalid(format!(
            "temperature {temperature} must be finite and >= 0"
        )));
    }
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        return Err(Error::Internal(format!("logit {i} is not finite")));
    }
    let (best, &max) = logits
        .iter()
        .enumerate()
        .fold((0, &logits[0]), |a, b| if b.1 > a.1 { b } else { a });
    if temperature == 0.0 {
        return Ok(best as u32);
    }
    let inv = 1.0 / f64::from(temperature);
    let w: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - f64::from(max)) * inv).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut r = rng.next_f64() * total;
    for (i, &p) in w.iter().enumerate() {
        if r < p {
            return Ok(i as u32);
        }
        r -= p;
    }
    Ok(best as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_sampling() {
        let mut rng = Rng::new(1);
        assert_eq!(sample(&[0.0, 3.0, 1.0], 0.0, &mut rng).unwrap(), 1);
        let mut counts = [0usize; 3];
        for _ in 0..20000 {
            counts[sample(&[0.0, 1.0, 2.0], 1.0, &mut rng).unwrap() as usize] += 1;
        }
        // softmax([0,1,2]) = [0.090, 0.245, 0.665]; 20k draws: sd ≈ 0.003.
        let p2 = counts[2] as f64 / 20000.0;
        assert!((p2 - 0.665).abs() < 0.02, "{counts:?}");
        assert!(sample(&[], 1.0, &mut rng).is_err());
        assert!(sample(&[1.0], -1.0, &mut rng).is_err());
        assert!(sample(&[f32::NAN], 1.0, &mut rng).is_err());
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(9);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(9);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
    }
}
