//! The decode inputs' step bookkeeping (what a device mirror is told changed) and the
//! capture of a model's attention inputs.

use super::*;

#[test]
fn synthetic_steps_write_as_many_rows_as_steps() {
    // The rows written since a version are as many as the steps since (up to n), as in a
    // session whose steps append; versions only grow.
    let n = 5;
    let mut st = StepSync::new(1, n);
    let v0 = st.version;
    for k in 1..=12u64 {
        st.step();
        let newer = st.row_version.iter().filter(|&&v| v > v0).count() as u64;
        assert_eq!(newer, k.min(n as u64), "after {k} steps");
        assert_eq!(st.sync(0).version - v0, k);
        assert!(st.row_version.iter().all(|&v| v <= st.version));
        let foxedge_core::contract::Journal { since, rows } = st.journal.view();
        assert_eq!(
            since + rows.len() as u64,
            st.version,
            "the journal ends at the version"
        );
    }
    assert_eq!(st.row_version[n - 1], v0 + 11, "newest first, cycling");
}

#[test]
fn a_clone_of_decode_inputs_is_a_new_cache() {
    let p = PrefillInputs {
        t: 3,
        heads: 2,
        head_dim: 4,
        q: vec![0.5; 24],
        k: vec![0.25; 24],
        v: vec![1.0; 24],
        log_f: vec![-0.1; 6],
        u: vec![1.0; 2],
    };
    let d = p.decode_at(3).unwrap();
    let e = d.clone();
    assert_eq!(d, e);
    let (a, b) = (d.cache_ids(), e.cache_ids());
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|x| !b.contains(x)), "{a:?} {b:?}");
}

#[test]
fn capture_gives_one_input_per_layer_with_the_models_bounds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = Arc::new(Model::open(root.join(crate::BUNDLED_MODEL)).unwrap());
    let tokens: Vec<u32> = b"\0def main():\n    return 0\n"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    let layers = capture_prefill(&model, &tokens).unwrap();
    let info = model.info();
    assert_eq!(layers.len(), info.layers);
    for (l, x) in layers.iter().enumerate() {
        x.validate().unwrap();
        assert_eq!(
            (x.t, x.heads, x.head_dim),
            (tokens.len(), info.heads, info.head_dim)
        );
        assert_eq!(Some(&x.u[..]), model.logit_bounds(l), "layer {l}");
    }
    assert!(capture_prefill(&model, &tokens[..1]).is_err());
}
