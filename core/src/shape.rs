//! The geometry of one attention call: sizes, memory layout and index arithmetic.
//! Shared by every backend so that they agree on what a "problem" is.

use crate::error::{Error, Result};

/// Memory layout of q, k, v, out and the log gates, as in the reference API.
///
/// - `SeqFirst`: q/out `[batch, seq_q, heads_q, d]`, k/v `[batch, seq_k, heads_kv, d]`,
///   log gates `[batch, seq_k, heads_q]` (the reference default, `head_first=False`).
/// - `HeadFirst`: q/out `[batch, heads_q, seq_q, d]`, k/v `[batch, heads_kv, seq_k, d]`,
///   log gates `[batch, heads_q, seq_k]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    #[default]
    SeqFirst,
    HeadFirst,
}

/// Sizes of one forgetting-attention call.
///
/// Invariants checked by [`AttentionShape::validate`]: every size > 0, `seq_q <= seq_k`
/// (the queries are the last `seq_q` of `seq_k` positions), `heads_q % heads_kv == 0`
/// (grouped-query attention: query head `h` reads kv head `h / (heads_q / heads_kv)`),
/// `head_dim % 8 == 0`, and all element counts fit in `usize`.
///
/// Forget gates are per query head (each query head has its own decay), as in the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub head_dim: usize,
    pub layout: Layout,
}

impl AttentionShape {
    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0
            || self.heads_q == 0
            || self.heads_kv == 0
            || self.seq_q == 0
            || self.seq_k == 0
            || self.head_dim == 0
        {
            return Err(Error::BadShape("every size must be > 0"));
        }
        if self.seq_q > self.seq_k {
            return Err(Error::BadShape("seq_q must be <= seq_k"));
        }
        if self.heads_q % self.heads_kv != 0 {
            return Err(Error::BadShape("heads_q must be a multiple of heads_kv"));
        }
        if self.head_dim % 8 != 0 {
            return Err(Error::BadShape("head_dim must be a multiple of 8"));
        }
        let q = self.batch.checked_mul(self.heads_q);
        let q = q.and_then(|x| x.checked_mul(self.seq_k));
        let q = q.and_then(|x| x.checked_mul(self.head_dim));
        let kv = self
            .batch
            .checked_mul(self.heads_kv)
            .and_then(|x| x.checked_mul(self.seq_k))
            .and_then(|x| x.checked_mul(self.head_dim));
        if q.is_none() || kv.is_none() {
            return Err(Error::BadShape("element count overflows usize"));
        }
        Ok(())
    }

    /// Position of the first query in key coordinates: `seq_k - seq_q`.
    #[inline]
    pub fn q_offset(&self) -> usize {
        self.seq_k - self.seq_q
    }

    /// Query heads per kv head (the GQA group size).
    #[inline]
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// Elements of q and out.
    #[inline]
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }

    /// Elements of k and of v.
    #[inline]
    pub fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_k * self.head_dim
    }

    /// Elements of the log-gate tensor.
    #[inline]
    pub fn gate_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_k
    }

    /// Element offset of query (or output) vector `(b, t, h)`, `t < seq_q`.
    #[inline]
    pub fn q_at(&self, b: usize, t: usize, h: usize) -> usize {
        match self.layout {
            Layout::SeqFirst => ((b * self.seq_q + t) * self.heads_q + h) * self.head_dim,
            Layout::HeadFirst => ((b * self.heads_q + h) * self.seq_q + t) * self.head_dim,
        }
    }

    /// Element offset of key/value vector `(b, t, hk)`, `t < seq_k`, `hk < heads_kv`.
    #[inline]
    pub fn kv_at(&self, b: usize, t: usize, hk: usize) -> usize {
        match self.layout {
            Layout::SeqFirst => ((b * self.seq_k + t) * self.heads_kv + hk) * self.head_dim,
            Layout::HeadFirst => ((b * self.heads_kv + hk) * self.seq_k + t) * self.head_dim,
        }
    }

    /// Distance in elements between consecutive positions of one head in q/out.
    #[inline]
    pub fn q_row_stride(&self) -> usize {
        match self.layout {
            Layout::SeqFirst => self.heads_q * self.head_dim,
            Layout::HeadFirst => self.head_dim,
        }
    }

    /// Distance in elements between consecutive positions of one head in k/v.
    #[inline]
    pub fn kv_row_stride(&self) -> usize {
        match self.layout {
            Layout::SeqFirst => self.heads_kv * self.head_dim,
            Layout::HeadFirst => self.head_dim,
        }
    }

    /// Index of log gate `(b, t, h)`, `t < seq_k`.
    #[inline]
    pub fn gate_at(&self, b: usize, t: usize, h: usize) -> usize {
        match self.layout {
            Layout::SeqFirst => (b * self.seq_k + t) * self.heads_q + h,
            Layout::HeadFirst => (b * self.heads_q + h) * self.seq_k + t,
        }
    }

    /// Distance between consecutive positions of one head in the log-gate tensor.
    #[inline]
    pub fn gate_stride(&self) -> usize {
        match self.layout {
            Layout::SeqFirst => self.heads_q,
            Layout::HeadFirst => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(layout: Layout) -> AttentionShape {
        AttentionShape {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            seq_q: 3,
            seq_k: 5,
            head_dim: 8,
            layout,
        }
    }

    #[test]
    fn offsets_cover_buffers_exactly_once() {
        extern crate std;
        use std::vec;
        for layout in [Layout::SeqFirst, Layout::HeadFirst] {
            let s = shape(layout);
            s.validate().unwrap();
            let mut seen = vec![0u8; s.q_len()];
            for b in 0..s.batch {
                for t in 0..s.seq_q {
                    for h in 0..s.heads_q {
                        let o = s.q_at(b, t, h);
                        for x in &mut seen[o..o + s.head_dim] {
                            *x += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&x| x == 1));
            let mut seen = vec![0u8; s.gate_len()];
            for b in 0..s.batch {
                for t in 0..s.seq_k {
                    for h in 0..s.heads_q {
                        seen[s.gate_at(b, t, h)] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&x| x == 1));
            assert_eq!(
                s.q_at(1, 2, 3) + s.q_row_stride(),
                if layout == Layout::HeadFirst {
                    s.q_at(1, 2, 3) + 8
                } else {
                    s.q_at(1, 2, 3) + 32
                }
            );
        }
    }

    #[test]
    fn validate_rejects_bad_shapes() {
        let ok = shape(Layout::SeqFirst);
        let bad = [
            AttentionShape { batch: 0, ..ok },
            AttentionShape { seq_q: 6, ..ok },
            AttentionShape { heads_kv: 3, ..ok },
            AttentionShape { head_dim: 12, ..ok },
            AttentionShape {
                seq_k: usize::MAX / 2,
                ..ok
            },
        ];
        for s in bad {
            assert!(s.validate().is_err(), "{s:?}");
        }
    }
}
