//! Rust-side tests of the C ABI through its exported functions (the rlib): attention
//! storage types and layouts, and a model shared by sessions on several threads.
//! The C-side error tests are `tests/c_errors.c`, run by `scripts/ci.sh`.

use std::ffi::{CStr, CString, c_void};
use std::ptr;

use foxedge_ffi::*;

fn last_error() -> String {
    // SAFETY: never NULL, NUL-terminated.
    unsafe { CStr::from_ptr(fx_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Deterministic values in [-1, 1) that are exact in f16 and bf16 (multiples of 1/64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 128) as f32 / 64.0 - 1.0
        })
        .collect()
}

fn desc(layout: fx_layout) -> fx_attention_desc {
    let mut d = fx_attention_desc_default();
    (d.batch, d.heads_q, d.heads_kv, d.seq_q, d.seq_k, d.head_dim) = (2, 4, 2, 70, 90, 16);
    d.layout = layout as i32;
    d.block_q = 16;
    d.block_k = 16;
    d
}

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
}

fn inputs(d: &fx_attention_desc) -> Inputs {
    let nq = d.batch * d.heads_q * d.seq_q * d.head_dim;
    let nk = d.batch * d.heads_kv * d.seq_k * d.head_dim;
    Inputs {
        q: values(nq, 1),
        k: values(nk, 2),
        v: values(nk, 3),
        g: values(d.batch * d.heads_q * d.seq_k, 4)
            .iter()
            .map(|x| -(x + 1.0) * 0.2)
            .collect(),
    }
}

fn forward(
    d: &fx_attention_desc,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    g: &[f32],
) -> Vec<f32> {
    try_forward(d, q, k, v, g).unwrap_or_else(|st| panic!("{st:?}: {}", last_error()))
}

/// `fx_attention_forward`'s output, or its status when it is not `FX_OK`.
fn try_forward(
    d: &fx_attention_desc,
    q: *const c_void,
    k: *const c_void,
    v: *const c_void,
    g: &[f32],
) -> Result<Vec<f32>, fx_status> {
    let mut out = vec![0.0f32; d.batch * d.heads_q * d.seq_q * d.head_dim];
    // SAFETY: buffers sized as the descriptor states.
    let st = unsafe {
        fx_attention_forward(
            d,
            q,
            k,
            v,
            g.as_ptr(),
            out.as_mut_ptr().cast(),
            ptr::null_mut(),
        )
    };
    if st == fx_status::FX_OK {
        Ok(out)
    } else {
        Err(st)
    }
}

#[test]
fn f16_and_bf16_storage_match_f32_on_exact_values() {
    let mut d = desc(fx_layout::FX_LAYOUT_SEQ_FIRST);
    let x = inputs(&d);
    let want = forward(
        &d,
        x.q.as_ptr().cast(),
        x.k.as_ptr().cast(),
        x.v.as_ptr().cast(),
        &x.g,
    );
    for dt in [fx_dtype::FX_DTYPE_F16, fx_dtype::FX_DTYPE_BF16] {
        d.dtype = dt as i32;
        let conv = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|&f| match dt {
                    fx_dtype::FX_DTYPE_F16 => half::f16::from_f32(f).to_bits(),
                    _ => half::bf16::from_f32(f).to_bits(),
                })
                .collect()
        };
        let (q, k, v) = (conv(&x.q), conv(&x.k), conv(&x.v));
        let got = forward(
            &d,
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            v.as_ptr().cast(),
            &x.g,
        );
        // Same values (exact in both formats) and f32 compute: only summation order may differ.
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= 1e-5, "{dt:?}: max abs diff {err}");
    }
}

#[test]
fn head_first_layout_is_a_transpose_of_seq_first() {
    let ds = desc(fx_layout::FX_LAYOUT_SEQ_FIRST);
    let dh = desc(fx_layout::FX_LAYOUT_HEAD_FIRST);
    let x = inputs(&ds);
    let (b, hq, hk, sq, sk, hd) = (
        ds.batch,
        ds.heads_q,
        ds.heads_kv,
        ds.seq_q,
        ds.seq_k,
        ds.head_dim,
    );
    // [b, t, h, d] -> [b, h, t, d]
    let tr = |src: &[f32], t: usize, h: usize, d: usize| {
        let mut dst = vec![0.0; src.len()];
        for bi in 0..b {
            for ti in 0..t {
                for hi in 0..h {
                    for c in 0..d {
                        dst[((bi * h + hi) * t + ti) * d + c] =
                            src[((bi * t + ti) * h + hi) * d + c];
                    }
                }
            }
        }
        dst
    };
    let seq = forward(
        &ds,
        x.q.as_ptr().cast(),
        x.k.as_ptr().cast(),
        x.v.as_ptr().cast(),
        &x.g,
    );
    let (q, k, v, g) = (
        tr(&x.q, sq, hq, hd),
        tr(&x.k, sk, hk, hd),
        tr(&x.v, sk, hk, hd),
        tr(&x.g, sk, hq, 1),
    );
    let head = forward(
        &dh,
        q.as_ptr().cast(),
        k.as_ptr().cast(),
        v.as_ptr().cast(),
        &g,
    );
    let want = tr(&seq, sq, hq, hd);
    let err = head
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(err <= 1e-6, "max abs diff {err}");
}

fn model_dir() -> CString {
    CString::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/fox-tiny-pro"
    ))
    .unwrap()
}

struct Model(*mut fx_model);
// SAFETY: the header documents fx_model as immutable and shareable across threads; this
// test is what checks that promise.
unsafe impl Send for Model {}
// SAFETY: as above.
unsafe impl Sync for Model {}

fn run_session(m: &Model, prompt: &[i32], steps: usize) -> Vec<f32> {
    let mut s = ptr::null_mut();
    // SAFETY: live model, NULL options, valid out.
    let st = unsafe { fx_session_new(m.0, ptr::null(), &mut s) };
    assert_eq!(st, fx_status::FX_OK, "{}", last_error());
    let mut logits = vec![0.0f32; 256];
    let mut trace = Vec::new();
    // SAFETY: live session used by this thread only; buffers sized as documented.
    unsafe {
        assert_eq!(
            fx_session_feed(s, prompt.as_ptr(), prompt.len(), logits.as_mut_ptr()),
            fx_status::FX_OK
        );
        for _ in 0..steps {
            let next = (0..256)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as i32;
            trace.push(next as f32);
            assert_eq!(
                fx_session_feed(s, &next, 1, logits.as_mut_ptr()),
                fx_status::FX_OK
            );
        }
        fx_session_free(s);
    }
    trace.extend_from_slice(&logits);
    trace
}

#[test]
fn one_model_serves_sessions_on_several_threads() {
    let mut m = ptr::null_mut();
    let dir = model_dir();
    // SAFETY: valid path, NULL options, valid out.
    let st = unsafe { fx_model_open(dir.as_ptr(), ptr::null(), &mut m) };
    assert_eq!(st, fx_status::FX_OK, "{}", last_error());
    let m = Model(m);
    let prompts: Vec<Vec<i32>> = ["def f(x):", "import numpy", "class A:"]
        .iter()
        .map(|p| std::iter::once(0).chain(p.bytes().map(i32::from)).collect())
        .collect();
    let alone: Vec<Vec<f32>> = prompts.iter().map(|p| run_session(&m, p, 8)).collect();
    let together: Vec<Vec<f32>> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(|| run_session(&m, p, 8)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        alone, together,
        "concurrent sessions on one model must not interfere"
    );
    // SAFETY: every session is freed; freed once.
    unsafe { fx_model_free(m.0) };
}

/// `fx_model_options.weights` takes effect: a model opened with Q8 dense layers and
/// bf16 vocabulary matrices gives logits near the as-stored (f32) model's but not the same
/// bits; a version-1 struct (no weight fields) opens as stored.
#[test]
fn model_options_choose_the_weight_format() {
    let dir = model_dir();
    let open = |o: &fx_model_options| {
        let mut m = ptr::null_mut();
        // SAFETY: valid path, options and out pointer.
        let st = unsafe { fx_model_open(dir.as_ptr(), o, &mut m) };
        assert_eq!(st, fx_status::FX_OK, "{}", last_error());
        Model(m)
    };
    let prompt: Vec<i32> = std::iter::once(0)
        .chain("def main():".bytes().map(i32::from))
        .collect();
    let base = open(&fx_model_options_default());
    let want = run_session(&base, &prompt, 0);
    let mut o = fx_model_options_default();
    o.weights = fx_weight_format::FX_WEIGHTS_Q8 as i32;
    o.vocab_weights = fx_weight_format::FX_WEIGHTS_BF16 as i32;
    o.threads = 2;
    let q8 = open(&o);
    let got = run_session(&q8, &prompt, 0);
    let (num, den) = got
        .iter()
        .zip(&want)
        .fold((0.0f64, 0.0f64), |(n, d), (&a, &b)| {
            (n + f64::from(a - b).powi(2), d + f64::from(b).powi(2))
        });
    let rel = (num / den).sqrt();
    // Q8 weights and activations (~0.5% per product) carried through 4 blocks.
    assert!(rel > 0.0 && rel < 0.05, "q8 logits rel L2 {rel}");
    o.struct_size = 16;
    let v1 = open(&o);
    assert_eq!(run_session(&v1, &prompt, 0), want);
    // SAFETY: no session is alive; each model freed once.
    unsafe {
        fx_model_free(base.0);
        fx_model_free(q8.0);
        fx_model_free(v1.0);
    }
}

/// Whether a missing Vulkan device fails a test: `CI` is set, and not to "", "0" or "false".
/// Without `CI` such a test prints why it skips and passes.
#[cfg(feature = "vulkan")]
fn vulkan_required() -> bool {
    std::env::var_os("CI").is_some_and(|v| {
        let v = v.to_string_lossy();
        !matches!(v.trim().to_ascii_lowercase().as_str(), "" | "0" | "false")
    })
}

/// The Vulkan kernels through the same entry point agree with the CPU kernels (CI runs this
/// on Mesa's lavapipe). f32 compute on both; the tolerance covers the device's `exp` and a
/// different summation order over 90 keys with |v| <= 1. Without a Vulkan device the entry
/// point answers `FX_ERR_BACKEND_UNAVAILABLE`, and the test skips (fails with `CI` set).
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_backend_matches_cpu_through_the_abi() {
    let test = "vulkan_backend_matches_cpu_through_the_abi";
    for layout in [
        fx_layout::FX_LAYOUT_SEQ_FIRST,
        fx_layout::FX_LAYOUT_HEAD_FIRST,
    ] {
        let mut d = desc(layout);
        let x = inputs(&d);
        let (q, k, v) = (
            x.q.as_ptr().cast(),
            x.k.as_ptr().cast(),
            x.v.as_ptr().cast(),
        );
        let cpu = forward(&d, q, k, v, &x.g);
        d.backend = fx_backend::FX_BACKEND_VULKAN as i32;
        let gpu = match try_forward(&d, q, k, v, &x.g) {
            Ok(gpu) => gpu,
            Err(fx_status::FX_ERR_BACKEND_UNAVAILABLE) => {
                if vulkan_required() {
                    panic!(
                        "{test}: CI is set, so a Vulkan device is required: {}",
                        last_error()
                    );
                }
                eprintln!(
                    "SKIPPED {test}: no Vulkan device ({}); with CI set this fails",
                    last_error()
                );
                return;
            }
            Err(st) => panic!("{test}: {st:?}: {}", last_error()),
        };
        let err = gpu
            .iter()
            .zip(&cpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err <= 1e-4, "{layout:?}: max abs diff {err}");
    }
}
