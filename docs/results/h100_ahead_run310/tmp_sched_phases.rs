// Scratch timing tests of session 22 (not kept in the tree). To rerun: paste the two tests
// into `mod tests` of src/hybrid.rs at 89c6ef2, add the phase counters below to
// Scheduler::prefill (PH[0] after planned_costs, PH[1] around the work closure, PH[2] around
// choose, PH[3] around record, PH[4] around learn), then
//   cargo test --release -p foxedge --lib tmp_ -- --ignored --nocapture
// Dev machine: "t 1024 sched 56.9 us/call; costs 1.4 work 43.3 choose(all) 51.5 record 0.5
// learn 2.8" and "t 1024: whole 24.6 us; alloc 1.5 cumsum 12.0 head_boundary 8.9 count 1.9".

pub static PH: [std::sync::atomic::AtomicU64; 6] = [const { std::sync::atomic::AtomicU64::new(0) }; 6];
fn ph(i: usize, t: Instant) { PH[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed); }

#[test]
#[ignore]
fn tmp_sched_phases() {
    let eng = Engine::auto_over_idle_device();
    let EngineInner::Sched(s) = &eng.inner else { panic!() };
    let lc = |a: f64, b: f64, c: f64| LinearCost { a, b, c };
    *s.calibration.lock().unwrap() = Some(Calibration {
        cpu_prefill: lc(313e-6, 0.532e-9, 64.8e-9),
        gpu_prefill: lc(263e-6, 0.0, 64.4e-9),
        cpu_decode: lc(8e-6, 6.965e-9, 1.1e-9),
        gpu_decode: lc(215e-6, 0.552e-9, 1041e-9),
        gpu_decode_resident: true,
        concurrent: true,
        split_fixed: 79e-6,
        split_row_prefill: 223e-9,
        seconds: 0.0,
        cpu_prefill_share: Some(1.0),
        cpu_decode_share: Some(1.0),
    });
    let t: usize = std::env::var("TT").ok().and_then(|x| x.parse().ok()).unwrap_or(1024);
    let p = problem(t, 16, 64);
    let mut out = vec![0.0f32; p.q.len()];
    for _ in 0..20 { eng.prefill(&p, AcpMode::Bound { ln_eps: -10.0 }, &mut out).unwrap(); }
    for x in &PH { x.store(0, Ordering::Relaxed); }
    let before = s.plan_counts().scheduler_ns;
    let n = 200;
    for _ in 0..n { eng.prefill(&p, AcpMode::Bound { ln_eps: -10.0 }, &mut out).unwrap(); }
    let pc = s.plan_counts();
    let us = |x: u64| x as f64 / n as f64 / 1e3;
    eprintln!("t {t} sched {:.1} us/call; costs {:.1} work {:.1} choose(all) {:.1} record {:.1} learn {:.1}; plans {:?}",
        us(pc.scheduler_ns - before), us(PH[0].load(Ordering::Relaxed)), us(PH[1].load(Ordering::Relaxed)),
        us(PH[2].load(Ordering::Relaxed)), us(PH[3].load(Ordering::Relaxed)), us(PH[4].load(Ordering::Relaxed)), pc);
}

fn med(mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..2000).map(|_| { let t0 = Instant::now(); f(); t0.elapsed().as_secs_f64() * 1e6 }).collect();
    v.sort_by(f64::total_cmp);
    v[1000]
}

#[test]
#[ignore]
fn tmp_boundary_parts() {
    let t: usize = std::env::var("TT").ok().and_then(|x| x.parse().ok()).unwrap_or(1024);
    let nh = 16;
    let p = problem(t, nh, 64);
    let call = p.call(AcpMode::Bound { ln_eps: -10.0 });
    let grid = BlockGrid::new(BLOCK, BLOCK, t, t).unwrap();
    let nqb = grid.q_blocks();
    let whole = med(|| { std::hint::black_box(prefill_boundary(&call).unwrap()); });
    let alloc = med(|| { let v = vec![0.0f64; nh * t]; std::hint::black_box(&v); });
    let mut c = vec![0.0f64; nh * t];
    let cs = med(|| { gate::cumsum_rows(call.log_f, nh, 0.0, &mut c).unwrap(); std::hint::black_box(&c); });
    let mut st = vec![0u32; nh * nqb];
    let hb = med(|| { for h in 0..nh { head_boundary(&call, &grid, h, &c[h*t..][..t], &mut st[h*nqb..][..nqb]).unwrap(); } });
    let cp = med(|| { for h in 0..nh { std::hint::black_box(boundary::count_pairs(&grid, &st[h*nqb..][..nqb], 0)); } });
    eprintln!("t {t}: whole {whole:.1} us; alloc {alloc:.1} cumsum {cs:.1} head_boundary {hb:.1} count {cp:.1}");
}
