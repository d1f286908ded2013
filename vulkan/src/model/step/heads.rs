//! The stream's cache heads on the device: loading a head's rows from the host, growing a
//! head's buffer (its rows copied over), and applying row operations (`cache_ops.comp`, in
//! dependency levels).

use super::*;

impl DeviceStream {
    /// Replaces the rows of head `h` of layer `l` with the host's: K and V (`[rows][head_dim]`
    /// each), `c` (relative to the head's gate origin) and stream positions; one submission
    /// of its own (not counted in a run's). A caller whose bookkeeping made other row
    /// operations than the device (a step's evictions past those its plan listed) puts the
    /// device's head back in step with its own this way.
    ///
    /// Errors: lengths that do not match ([`Error::Input`]), a non-finite `c`, device
    /// failures.
    pub fn load_head(
        &mut self,
        l: usize,
        h: usize,
        k: &[f32],
        v: &[f32],
        c: &[f64],
        pos: &[u64],
    ) -> Result<()> {
        let sh = self.model.shape;
        let hd = sh.head_dim;
        let n = c.len();
        if l >= sh.layers || h >= sh.heads {
            return Err(Error::Input(foxedge_core::Error::BadArgument(
                "load_head: no such layer or head",
            )));
        }
        for (what, got, expected) in [
            ("load_head: keys (rows * head_dim)", k.len(), n * hd),
            ("load_head: values (rows * head_dim)", v.len(), n * hd),
            ("load_head: positions (one per row)", pos.len(), n),
        ] {
            if got != expected {
                return Err(foxedge_core::Error::BadLength {
                    what,
                    expected,
                    got,
                }
                .into());
            }
        }
        if c.iter().any(|x| !x.is_finite()) {
            return Err(Error::Input(foxedge_core::Error::BadArgument(
                "cache c_j must be finite",
            )));
        }
        let ctx = self.model.ctx.clone();
        let mut rec = Rec::new(&ctx)?;
        let hb = self.ensure_head(&mut rec, l, h, n.max(1))?;
        let mut words: Vec<u32> = Vec::with_capacity(2 * n * hd + 4 * n);
        words.extend(k.iter().map(|x| x.to_bits()));
        words.extend(v.iter().map(|x| x.to_bits()));
        crate::decode::meta_words(c, Some(pos), &mut words);
        let src = ctx.host_buffer(words.len(), true)?;
        src.write()
            .map_err(|e| Error::Vulkan(e.to_string()))?
            .get_mut(..words.len())
            .ok_or_else(|| internal("staging buffer too small"))?
            .copy_from_slice(&words);
        if n > 0 {
            copy(
                &mut rec,
                &src,
                &hb.buf,
                vec![
                    copy_region(0, 0, n * hd),
                    copy_region(n * hd, v_off(hb.cap, hd, false), n * hd),
                    copy_region(2 * n * hd, meta_off(hb.cap, hd, false), 4 * n),
                ],
            )?;
        }
        ctx.submit(rec.b)
    }

    /// Grows head `h` of layer `l` to hold `need` rows (doubling, rows copied on the
    /// device); creates it at the first use.
    pub(super) fn ensure_head(
        &mut self,
        rec: &mut Rec<'_>,
        l: usize,
        h: usize,
        need: usize,
    ) -> Result<HeadBuf> {
        let hd = self.model.shape.head_dim;
        let ctx = self.model.ctx.clone();
        match &self.heads[l][h] {
            Some(hb) if hb.cap >= need => return Ok(hb.clone()),
            _ => {}
        }
        let cap = need.max(64).next_power_of_two();
        let buf = ctx.device_buffer(head_words(cap, hd, false))?;
        self.invalidate();
        if let Some(old) = &self.heads[l][h] {
            let oc = old.cap;
            copy(
                rec,
                &old.buf,
                &buf,
                vec![
                    copy_region(0, 0, oc * hd),
                    copy_region(v_off(oc, hd, false), v_off(cap, hd, false), oc * hd),
                    copy_region(meta_off(oc, hd, false), meta_off(cap, hd, false), 4 * oc),
                ],
            )?;
        }
        let hb = HeadBuf { buf, cap };
        self.heads[l][h] = Some(hb.clone());
        Ok(hb)
    }

    /// Records the row operations of every head (`steps[h].ops`), one workgroup per head,
    /// in dependency levels ([`levels`]).
    pub(super) fn apply_ops(
        &mut self,
        rec: &mut Rec<'_>,
        l: usize,
        n: usize,
        steps: &[HeadStep],
        stats: &mut RunStats,
    ) -> Result<()> {
        let hd = self.model.shape.head_dim;
        let mut heads: Vec<(usize, HeadBuf)> = Vec::new();
        let mut words: Vec<u32> = Vec::new();
        let mut ranges: Vec<u32> = Vec::new();
        for (h, st) in steps.iter().enumerate() {
            if st.ops.is_empty() {
                continue;
            }
            let mut need = st.live;
            for op in &st.ops {
                match *op {
                    RowOp::Move { from, to } => need = need.max(from.max(to) as usize + 1),
                    RowOp::Meta { slot, .. } => need = need.max(slot as usize + 1),
                    RowOp::Put { token, slot, .. } => {
                        if token as usize >= n {
                            return Err(Error::Input(foxedge_core::Error::BadArgument(
                                "a Put names a token outside the run",
                            )));
                        }
                        need = need.max(slot as usize + 1);
                    }
                }
            }
            if need > u32::MAX as usize / 4 {
                return Err(Error::Unsupported("cache head too large".into()));
            }
            let hb = self.ensure_head(rec, l, h, need)?;
            let first = words.len() / 8;
            levels::leveled_words(&st.ops, &mut words)?;
            ranges.extend([first as u32, st.ops.len() as u32, h as u32, hb.cap as u32]);
            heads.push((h, hb));
        }
        if heads.is_empty() {
            return Ok(());
        }
        let mut hdata = HostData::new(storage_align(rec.ctx));
        let ops_at = hdata.push(&words);
        let mut range_at = Vec::new();
        for g in ranges.chunks(4 * HPD) {
            range_at.push(hdata.push(g));
        }
        let (hbuf, up) = hdata.upload(rec)?;
        stats.bytes_uploaded += up;
        let s = self
            .scratch
            .as_ref()
            .ok_or_else(|| internal("no scratch"))?;
        for (g, ra) in heads.chunks(HPD).zip(range_at) {
            let bufs = g.iter().map(|(_, hb)| hb.buf.clone()).collect();
            rec.cache_ops(
                hd,
                n,
                bufs,
                &s.k,
                &s.v,
                &view(&hbuf, ops_at),
                &view(&hbuf, ra),
            )?;
        }
        Ok(())
    }
}

/// Appends the 8 words of `op` for `cache_ops.comp`.
pub(super) fn op_words(op: &RowOp, words: &mut Vec<u32>) -> Result<()> {
    match *op {
        RowOp::Move { from, to } => words.extend([0, from, to, 0, 0, 0, 0, 0]),
        RowOp::Put { slot, c, pos, .. } | RowOp::Meta { slot, c, pos } => {
            if !c.is_finite() {
                return Err(Error::Input(foxedge_core::Error::BadArgument(
                    "cache c_j must be finite",
                )));
            }
            let mut cw = [0u32; 2];
            split_f64(&[c], &mut cw);
            let (kind, token) = match *op {
                RowOp::Put { token, .. } => (1, token),
                _ => (2, 0),
            };
            words.extend([
                kind,
                token,
                slot,
                0,
                cw[0],
                cw[1],
                pos as u32,
                (pos >> 32) as u32,
            ]);
        }
    }
    Ok(())
}
