//! Host-side cost of one `Vulkan::prefill` call, split as the public API allows:
//! `prepare_prefill` (decisions + packing + upload), `run(1)` (kernel, submit to fence) and
//! `read` (download + unpack), plus whole `prefill` calls. With `FOXEDGE_VULKAN_PROFILE=1`
//! every `prefill` call also prints its finer phases on stderr.
//!
//! `cargo run --release -p foxedge-vulkan --example vk_prefill_host -- [--heads 16]
//!  [--lengths 4096,16384] [--dim 64] [--reps 3] [--f16] [--seq-first] [--acp] [--copy]`
//!
//! `--acp`: strong decay with a fixed threshold, so most blocks are pruned and the kernel
//! (slow on lavapipe) stops hiding the host phases; packing, upload and readback do not
//! depend on it. `--copy`: copy the inputs and outputs to and from device-local buffers
//! even on unified memory (`Vulkan::set_prefill_direct(false)`).

#[path = "common/mod.rs"]
#[allow(dead_code)]
mod bench;

use bench::{arg_list, median};
use foxedge_vulkan::{Acp, AttentionShape, Layout, PrefillArgs, PrefillOptions, Storage, Vulkan};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn case<T: Storage>(vk: &Vulkan, sh: AttentionShape, reps: usize, acp: bool) {
    let mut r = StdRng::seed_from_u64(7);
    let mut rnd = |n: usize| -> Vec<T> {
        (0..n)
            .map(|_| T::from_f32(r.r#gen::<f32>() * 2.0 - 1.0))
            .collect()
    };
    let (q, k, v) = (rnd(sh.q_len()), rnd(sh.kv_len()), rnd(sh.kv_len()));
    let g = vec![if acp { -1.0f32 } else { -0.01 }; sh.gate_len()];
    let thr = vec![-30.0f64; sh.batch * sh.heads_q];
    let args = PrefillArgs {
        shape: sh,
        q: &q,
        k: &k,
        v: &v,
        log_fgate: &g,
        seq_start: None,
    };
    let opts = PrefillOptions {
        acp: if acp { Acp::Threshold(&thr) } else { Acp::Off },
        ..Default::default()
    };
    let mut out = vec![0.0f32; sh.q_len()];
    let mut lse = vec![0.0f32; sh.batch * sh.heads_q * sh.seq_q];
    let (mut pre, mut run, mut read, mut total) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let t = Instant::now();
        let p = vk.prepare_prefill(&args, &opts).expect("prepare");
        pre.push(ms(t));
        let t = Instant::now();
        p.run(1).expect("run");
        run.push(ms(t));
        let t = Instant::now();
        p.read(&mut out, Some(&mut lse)).expect("read");
        read.push(ms(t));
        drop(p);
        let t = Instant::now();
        vk.prefill(&args, &opts, &mut out, Some(&mut lse))
            .expect("prefill");
        total.push(ms(t));
    }
    // FNV-1a of the output and lse bits: equal across builds when the results are.
    let hash = out
        .iter()
        .chain(&lse)
        .fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
            (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
        });
    println!(
        "{:?} heads {} L {} d {} acp {acp}: prepare {:.1} ms, run {:.1} ms, read {:.1} ms; \
         prefill {:.1} ms (medians of {reps}); result hash {hash:016x}; pooled buffers {} MiB",
        T::DTYPE,
        sh.heads_q,
        sh.seq_q,
        sh.head_dim,
        median(pre),
        median(run),
        median(read),
        median(total),
        vk.prefill_buffer_bytes() >> 20
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |n: &str| args.iter().any(|a| a == n);
    let one = |n: &str, dflt: usize| arg_list(&args, n, &[dflt])[0];
    let heads = one("--heads", 16);
    let d = one("--dim", 64);
    let reps = one("--reps", 3).max(1);
    let lengths = arg_list(&args, "--lengths", &[4096]);
    let vk = Vulkan::new().expect("vulkan device");
    if flag("--copy") {
        vk.set_prefill_direct(false);
    }
    println!(
        "device: {}; buffers {}",
        vk.info(),
        if flag("--copy") || !vk.info().unified_memory {
            "copied"
        } else {
            "bound directly"
        }
    );
    for &l in &lengths {
        let sh = AttentionShape {
            batch: 1,
            heads_q: heads,
            heads_kv: heads,
            seq_q: l,
            seq_k: l,
            head_dim: d,
            layout: if flag("--seq-first") {
                Layout::SeqFirst
            } else {
                Layout::HeadFirst
            },
        };
        if flag("--f16") {
            case::<f16>(&vk, sh, reps, flag("--acp"));
        } else {
            case::<f32>(&vk, sh, reps, flag("--acp"));
        }
    }
}
