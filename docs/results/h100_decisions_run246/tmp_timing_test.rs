
#[cfg(test)]
mod tmp_timing {
    use super::*;
    use std::time::Instant;

    fn med(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    #[test]
    #[ignore]
    fn tmp_boundary_parts() {
        let (t, nh, d) = (1024usize, 16usize, 64usize);
        let n = t * nh * d;
        let q = vec![0.1f32; n];
        let log_f: Vec<f32> = (0..t * nh)
            .map(|i| -0.001 * (1 + 50 * (i % nh)) as f32)
            .collect();
        let u = vec![(d as f64).sqrt(); nh];
        let call = PrefillCall {
            t,
            heads: nh,
            head_dim: d,
            q: &q,
            k: &q,
            v: &q,
            log_f: &log_f,
            acp: Acp::Bound {
                u: &u,
                ln_eps: -10.0,
            },
            decided: None,
        };
        let grid = BlockGrid::new(BLOCK, BLOCK, t, t).unwrap();
        let reps = 2000;
        let time = |f: &mut dyn FnMut()| {
            med((0..reps)
                .map(|_| {
                    let s = Instant::now();
                    f();
                    s.elapsed().as_secs_f64() * 1e6
                })
                .collect())
        };
        let mut c = vec![0.0f64; t];
        let mut st = vec![0u32; grid.q_blocks()];
        println!(
            "validate_log_gates {:.2} us",
            time(&mut || gate::validate_log_gates(&log_f).unwrap())
        );
        println!(
            "cumsum x16 {:.2} us",
            time(&mut || for h in 0..nh {
                gate::cumsum_strided(&log_f[h..], nh, 0.0, &mut c).unwrap()
            })
        );
        println!(
            "start_blocks x16 {:.2} us",
            time(&mut || for _ in 0..nh {
                boundary::start_blocks(&grid, &c, Some(5.0), 0, &mut st).unwrap()
            })
        );
        println!(
            "threshold x16 {:.2} us",
            time(&mut || for _ in 0..nh {
                std::hint::black_box(threshold::threshold(8.0, t, -10.0).unwrap());
            })
        );
        println!(
            "count_pairs x16 {:.2} us",
            time(&mut || for _ in 0..nh {
                std::hint::black_box(boundary::count_pairs(&grid, &st, 0));
            })
        );
        println!(
            "head_boundary x16 serial {:.2} us",
            time(&mut || for h in 0..nh {
                head_boundary(&call, &grid, h, &mut c, &mut st).unwrap();
            })
        );
        let mut cc = vec![0.0f64; t * nh];
        println!(
            "cumsum_rows {:.2} us",
            time(&mut || gate::cumsum_rows(&log_f, nh, 0.0, &mut cc).unwrap())
        );
        println!(
            "alloc c {:.2} us",
            time(&mut || {
                std::hint::black_box(vec![0.0f64; t * nh]);
            })
        );
        println!(
            "prefill_boundary (par) {:.2} us",
            time(&mut || {
                std::hint::black_box(prefill_boundary(&call).unwrap());
            })
        );
        let mut junk = vec![1u8; 64 << 20];
        let cold = med((0..200)
            .map(|i| {
                junk.iter_mut().step_by(64).for_each(|x| *x = x.wrapping_add(i as u8));
                let s = Instant::now();
                std::hint::black_box(prefill_boundary(&call).unwrap());
                s.elapsed().as_secs_f64() * 1e6
            })
            .collect());
        println!("prefill_boundary cold caches {cold:.2} us");
        let b = prefill_boundary(&call).unwrap();
        let dec = foxedge_cpu::Decisions {
            c: &b.c,
            start_blocks: &b.start_blocks,
            delta: &b.delta,
        };
        println!(
            "check_decisions {:.2} us",
            time(&mut || foxedge_cpu::check_decisions(&dec, &grid, nh, t).unwrap())
        );
    }
}
