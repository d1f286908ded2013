//! Leveled application equals serial application: on a host model of the rows (each level
//! applied at once, its operations reading the rows as they were before the level), and
//! `cache_ops.comp` on the device (lavapipe here and in CI) against the serial host
//! application of `rowops.glsl`, word for word.

use super::{leveled_words, levels, order, rows};
use crate::model::ops::Rec;
use crate::model::step::{RowOp, op_words};
use crate::model::weights::tests::device;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A row of the host model: (K and V, meta).
type Row = (u64, u64);

fn meta(op: &RowOp) -> u64 {
    match *op {
        RowOp::Put { c, pos, .. } | RowOp::Meta { c, pos, .. } => c.to_bits() ^ pos.rotate_left(7),
        RowOp::Move { .. } => 0,
    }
}

/// `op` applied to `out`, reading the rows of `src`.
fn apply(op: &RowOp, src: &[Row], out: &mut [Row]) {
    match *op {
        RowOp::Move { from, to } => out[to as usize] = src[from as usize],
        RowOp::Put { token, slot, .. } => out[slot as usize] = (1000 + token as u64, meta(op)),
        RowOp::Meta { slot, .. } => out[slot as usize].1 = meta(op),
    }
}

fn op(rows: u32) -> impl Strategy<Value = RowOp> {
    prop_oneof![
        4 => (0..rows, 0..rows).prop_map(|(from, to)| RowOp::Move { from, to }),
        3 => (0..64u32, 0..rows, -8.0..8.0f64, any::<u64>())
            .prop_map(|(token, slot, c, pos)| RowOp::Put { token, slot, c, pos }),
        1 => (0..rows, -8.0..8.0f64, any::<u64>()).prop_map(|(slot, c, pos)| RowOp::Meta { slot, c, pos }),
    ]
}

/// Operations on 12 rows: random ones, then swap-deletes (the last live row moves into the
/// deleted one) and a chain of moves.
fn ops() -> impl Strategy<Value = Vec<RowOp>> {
    (
        prop::collection::vec(op(12), 0..80),
        prop::collection::vec(0..12u32, 0..8),
        0..6u32,
    )
        .prop_map(|(mut ops, dels, chain)| {
            let mut live = 12u32;
            for d in dels {
                if live == 0 {
                    break;
                }
                live -= 1;
                ops.push(RowOp::Move {
                    from: live,
                    to: d.min(live),
                });
            }
            for i in 0..chain {
                ops.push(RowOp::Move { from: i + 1, to: i });
            }
            ops
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// No two operations of a level touch a common row unless both only read it, the order
    /// is a stable sort by level with each level's end, and applying the levels at once
    /// gives the serial result.
    #[test]
    fn leveled_application_equals_serial(ops in ops()) {
        let init: Vec<Row> = (0..12u64).map(|i| (i, 100 + i)).collect();
        let mut serial = init.clone();
        for o in &ops {
            let src = serial.clone();
            apply(o, &src, &mut serial);
        }
        let lv = levels(&ops);
        let (idx, end) = order(&ops);
        let mut seen = idx.clone();
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..ops.len()).collect::<Vec<_>>());
        let mut leveled = init;
        let mut at = 0;
        while at < idx.len() {
            let e = end[at] as usize;
            prop_assert!(e > at && e <= idx.len());
            let group = &idx[at..e];
            prop_assert!(group.windows(2).all(|w| w[0] < w[1]), "stable within a level");
            prop_assert!(group.iter().all(|&i| lv[i] == lv[group[0]] && end[at] == e as u32));
            if e < idx.len() {
                prop_assert!(lv[idx[e]] > lv[group[0]]);
            }
            for (x, &i) in group.iter().enumerate() {
                for &j in &group[x + 1..] {
                    let ((ri, wi), (rj, wj)) = (rows(&ops[i]), rows(&ops[j]));
                    prop_assert!(wi != wj && Some(wi) != rj && Some(wj) != ri);
                }
            }
            let src = leveled.clone();
            for &i in group {
                apply(&ops[i], &src, &mut leveled);
            }
            at = e;
        }
        prop_assert_eq!(leveled, serial);
    }
}

#[test]
fn independent_puts_are_one_level_and_a_chain_is_serial() {
    let puts: Vec<RowOp> = (0..100)
        .map(|i| RowOp::Put {
            token: i,
            slot: i,
            c: 0.5,
            pos: i as u64,
        })
        .collect();
    assert_eq!(levels(&puts), vec![1; 100]);
    let chain: Vec<RowOp> = (0..10)
        .map(|i| RowOp::Move { from: i + 1, to: i })
        .collect();
    // Each move writes the row the previous one read: ordered, one level each.
    assert_eq!(levels(&chain), (1..=10).collect::<Vec<u32>>());
    assert!(levels(&[]).is_empty());
}

/// `rowops.glsl` on the host: the 8 words of one op applied to a head buffer.
fn host_op(buf: &mut [u32], w: &[u32], cap: usize, hd: usize, chunk: (&[u32], &[u32])) {
    let (voff, moff) = (cap * hd, 2 * cap * hd);
    let (from, to) = (w[1] as usize, w[2] as usize);
    match w[0] {
        0 => {
            for (off, len) in [(0, hd), (voff, hd)] {
                buf.copy_within(off + from * len..off + (from + 1) * len, off + to * len);
            }
            buf.copy_within(moff + 4 * from..moff + 4 * from + 4, moff + 4 * to);
        }
        kind => {
            if kind == 1 {
                buf[to * hd..(to + 1) * hd].copy_from_slice(&chunk.0[from * hd..(from + 1) * hd]);
                buf[voff + to * hd..voff + (to + 1) * hd]
                    .copy_from_slice(&chunk.1[from * hd..(from + 1) * hd]);
            }
            buf[moff + 4 * to..moff + 4 * to + 4].copy_from_slice(&w[4..8]);
        }
    }
}

/// Random operations on a head of `cap` rows, for a chunk of `n` tokens, with swap-deletes
/// and chains of moves among many puts.
fn random_ops(r: &mut StdRng, cap: u32, n: u32, count: usize) -> Vec<RowOp> {
    let mut ops = Vec::with_capacity(count);
    while ops.len() < count {
        let slot = r.gen_range(0..cap);
        let c = r.gen_range(-30.0..0.0);
        let pos = r.r#gen::<u64>();
        match r.gen_range(0..10) {
            0..=4 => ops.push(RowOp::Put {
                token: r.gen_range(0..n),
                slot,
                c,
                pos,
            }),
            5..=6 => ops.push(RowOp::Move {
                from: r.gen_range(0..cap),
                to: slot,
            }),
            7 => ops.push(RowOp::Meta { slot, c, pos }),
            _ => {
                let from = r.gen_range(1..cap);
                ops.push(RowOp::Move { from, to: from - 1 });
            }
        }
    }
    ops
}

#[test]
fn cache_ops_shader_matches_serial_application() {
    let Some(ctx) = device("cache_ops_shader_matches_serial_application") else {
        return;
    };
    let mut r = StdRng::seed_from_u64(7);
    for (hd, heads, cap, n) in [
        (64usize, 8usize, 96usize, 40usize),
        (20, 3, 50, 17),
        (2, 5, 9, 6),
    ] {
        let chunk_words = heads * n * hd;
        let finite = |r: &mut StdRng| r.gen_range(-4.0f32..4.0).to_bits();
        let kx: Vec<u32> = (0..chunk_words).map(|_| finite(&mut r)).collect();
        let vx: Vec<u32> = (0..chunk_words).map(|_| finite(&mut r)).collect();
        let hw = 2 * cap * hd + 4 * cap;
        let mut words = Vec::new();
        let mut ranges = Vec::new();
        let mut expect = Vec::new();
        let mut init = Vec::new();
        for slot in 0..heads {
            // Head slot s holds chunk head (s * 3) % heads, a permutation of the heads.
            let h = (slot * 3) % heads;
            let buf: Vec<u32> = (0..hw).map(|_| r.r#gen()).collect();
            let count = [0, 1, 7, 300][slot % 4] + slot;
            let ops = random_ops(&mut r, cap as u32, n as u32, count);
            let first = words.len() / 8;
            leveled_words(&ops, &mut words).expect("words");
            ranges.extend([first as u32, ops.len() as u32, h as u32, cap as u32]);
            let mut want = buf.clone();
            let chunk = (
                &kx[h * n * hd..(h + 1) * n * hd],
                &vx[h * n * hd..(h + 1) * n * hd],
            );
            let mut w = Vec::new();
            for o in &ops {
                w.clear();
                op_words(o, &mut w).expect("words");
                host_op(&mut want, &w, cap, hd, chunk);
            }
            init.push(buf);
            expect.push(want);
        }
        let mut data: Vec<&[u32]> = init.iter().map(|b| &b[..]).collect();
        data.extend([&kx[..], &vx[..], &words[..], &ranges[..]]);
        let bufs = ctx.upload(&data).expect("upload");
        let mut rec = Rec::new(&ctx).expect("recorder");
        rec.cache_ops(
            hd,
            n,
            bufs[..heads].to_vec(),
            &bufs[heads],
            &bufs[heads + 1],
            &bufs[heads + 2],
            &bufs[heads + 3],
        )
        .expect("records");
        ctx.submit(rec.b).expect("runs");
        let refs: Vec<_> = bufs[..heads].iter().collect();
        let got = ctx.download(&refs).expect("download");
        for (slot, (g, e)) in got.iter().zip(&expect).enumerate() {
            assert!(
                g == e,
                "hd {hd}, head slot {slot}: the leveled result differs"
            );
        }
    }
}
