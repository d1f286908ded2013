// Not built: copy to benches/exp_align.rs and add to Cargo.toml:
//   [[bench]] name = "exp_align", harness = false
// Run: cargo bench -p foxedge --bench exp_align  (env: L=1024 ACP=1 B=batch R=rounds)
// Decode with K and V copied to 0, 16, 32 and 48 bytes past a 64-byte boundary, interleaved.
// Experiment: decode kernel time against the 64-byte alignment of K and V.
mod common;
use std::time::Instant;

fn main() -> foxedge::Result<()> {
    let len: usize = common::env_or("L", 1024);
    let big = common::workload(len)?;
    let d = big.prefix(len)?.decode_at(len)?;
    let (nh, hd, n) = (d.heads, d.head_dim, d.n);
    let ln_eps = -10.0;
    let acp_on = common::env_or("ACP", 1) == 1;
    // offsets in floats from a 64-byte boundary
    let offs: Vec<usize> = vec![0, 4, 8, 12];
    let mk = |src: &[f32], off: usize| -> (Vec<f32>, usize) {
        let mut buf = vec![0.0f32; src.len() + 32];
        let base = (64 - (buf.as_ptr() as usize % 64)) % 64 / 4;
        buf[base + off..base + off + src.len()].copy_from_slice(src);
        (buf, base + off)
    };
    let bufs: Vec<_> = offs
        .iter()
        .map(|&o| (mk(&d.k, o), mk(&d.v, o)))
        .collect();
    let mut out = vec![0.0f32; nh * hd];
    let run = |i: usize, out: &mut [f32]| {
        let ((kb, ko), (vb, vo)) = &bufs[i];
        let k = &kb[*ko..*ko + d.k.len()];
        let v = &vb[*vo..*vo + d.v.len()];
        let heads: Vec<foxedge_cpu::CacheHead<'_, f32>> = (0..nh)
            .map(|h| foxedge_cpu::CacheHead {
                k: &k[h * n * hd..(h + 1) * n * hd],
                v: &v[h * n * hd..(h + 1) * n * hd],
                c: &d.c[h * n..(h + 1) * n],
                pos: None,
            })
            .collect();
        let args = foxedge_cpu::DecodeArgs::one_query(hd, &d.q, &d.q_c, &heads);
        let opts = foxedge_cpu::DecodeOptions {
            acp: if acp_on {
                foxedge_cpu::Acp::Bound { u: &d.u, ln_eps }
            } else {
                foxedge_cpu::Acp::Off
            },
            ..Default::default()
        };
        foxedge_cpu::decode(&args, &opts, out, None).map(|_| ()).expect("decode");
    };
    for i in 0..offs.len() {
        for _ in 0..300 {
            run(i, &mut out);
        }
    }
    let batch: usize = common::env_or("B", 200);
    let mut t = vec![Vec::new(); offs.len()];
    let mut seed = 12345u64;
    let mut order: Vec<usize> = (0..offs.len()).collect();
    for _ in 0..common::env_or("R", 40) {
        for j in (1..order.len()).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            order.swap(j, (seed % (j as u64 + 1)) as usize);
        }
        for &i in &order {
            run(i, &mut out);
            let t0 = Instant::now();
            for _ in 0..batch {
                run(i, &mut out);
            }
            t[i].push(t0.elapsed().as_secs_f64() / batch as f64 * 1e6);
        }
    }
    for (i, o) in offs.iter().enumerate() {
        let mut s = t[i].clone();
        s.sort_by(f64::total_cmp);
        println!(
            "offset {:2} bytes: median {:.2} us  min {:.2} us  p25 {:.2} p75 {:.2}",
            o * 4,
            s[s.len() / 2],
            s[0],
            s[s.len() / 4],
            s[3 * s.len() / 4]
        );
    }
    Ok(())
}
