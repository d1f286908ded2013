//! Property: for any valid small shape (batch, GQA group, seq_q <= seq_k, head_dim a multiple
//! of 8 from 8 to 64 — which changes the kernel's threads per row and key tile —, layout,
//! left padding, block sizes, ACP on or off), the Vulkan prefill equals the f64 reference
//! within f32 rounding (dense) or within the pruned-mass bound (ACP), and reports the CPU
//! backend's statistics. Few cases: each one is a real device run on lavapipe.
mod common;

use common::*;
use foxedge_vulkan::{Acp, Layout, PrefillArgs, PrefillOptions};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn prefill_matches_reference_on_random_shapes(
        batch in 1usize..3,
        heads_kv in 1usize..3,
        group in 1usize..3,
        seq_k in 1usize..90,
        q_frac in 0.05f64..1.0,
        d8 in 1usize..9,
        head_first in any::<bool>(),
        pad_frac in 0.0f64..0.5,
        block_q in 1usize..70,
        block_k in 1usize..70,
        acp in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let Some(vk) = device() else { return Ok(()) };
        let seq_q = ((seq_k as f64 * q_frac).ceil() as usize).clamp(1, seq_k);
        let d = 8 * d8;
        let layout = if head_first { Layout::HeadFirst } else { Layout::SeqFirst };
        let sh = shape(batch, heads_kv * group, heads_kv, seq_q, seq_k, d, layout);
        let mut r = rng(seed);
        let q = randn(&mut r, sh.q_len(), 1.0);
        let k = randn(&mut r, sh.kv_len(), 1.0);
        let v = randn(&mut r, sh.kv_len(), 1.0);
        let g = log_gates(&mut r, sh.gate_len(), -1.0);
        let starts: Vec<usize> = (0..batch)
            .map(|b| ((seq_k as f64 * pad_frac) as usize + b) % seq_k)
            .collect();
        let u = vec![4.0f64; sh.heads_q];
        let opts = PrefillOptions {
            acp: if acp { Acp::Bound { u: &u, ln_eps: -10.0 } } else { Acp::Off },
            block_q,
            block_k,
            ..Default::default()
        };
        let args = PrefillArgs { shape: sh, q: &q, k: &k, v: &v, log_fgate: &g, seq_start: Some(&starts) };
        let mut out = vec![f32::NAN; sh.q_len()];
        let st = vk.prefill(&args, &opts, &mut out, None).expect("prefill");
        let scale = 1.0 / (d as f64).sqrt();
        let (ro, _) = reference_prefill(&sh, &to_f64(&q), &to_f64(&k), &to_f64(&v), &g, Some(&starts), scale);
        let (max, _) = errors(&out, &ro);
        // Dense: f32 rounding; ACP: plus 2 eps max|v| (eps = e^-10, |v| <= 3.4).
        let tol = if acp { 2.0 * 4.54e-5 * 3.4 + 2e-5 } else { 2e-5 };
        prop_assert!(max <= tol, "max |err| {max} > {tol} for {sh:?}");
        let cargs = foxedge_cpu::PrefillArgs { shape: sh, q: &q, k: &k, v: &v, log_fgate: &g, seq_start: Some(&starts) };
        let copts = foxedge_cpu::PrefillOptions {
            sm_scale: None,
            acp: if acp { foxedge_cpu::Acp::Bound { u: &u, ln_eps: -10.0 } } else { foxedge_cpu::Acp::Off },
            block_q,
            block_k,
            heads: None,
        };
        let mut cout = vec![0.0f32; sh.q_len()];
        let cst = foxedge_cpu::prefill(&cargs, &copts, &mut cout, None).expect("cpu");
        for (a, b) in st.heads.iter().zip(&cst.heads) {
            prop_assert_eq!((a.kept_pairs, a.total_pairs, a.kept_blocks, a.total_blocks), (b.kept_pairs, b.total_pairs, b.kept_blocks, b.total_blocks));
        }
    }
}
