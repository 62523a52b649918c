//! What comes back of a step: the picked tokens and their logits, the
//! rows asked for, the candidates asked for (of the adjusted rows, and of
//! the rows before their additions with those additions' tokens' logits),
//! all in one read.

use super::{GpuDecoder, GpuError, Read, StepIo};
use crate::backend::gpu::kernels::top::{TOP_N, TOP_STRIDE};
use crate::backend::gpu::DeviceBuf;
use crate::backend::rows::HostRows;
use crate::backend::{Pick, StepLogits};
use crate::sampling::TopCandidates;

impl GpuDecoder {
    /// What comes back of a step over `io` (its inputs `host`), for its
    /// first `n` sequences, in one read: the picked tokens, the logits of
    /// the sequences that ask for them (all, without device picks), the
    /// candidates of those that ask for them, with the picked token's
    /// logit beside them, and a scored sequence's candidates before its
    /// additions with the logits of the tokens they add to
    /// ([`Pick::Scored`]). With device picks, the logits' buffer is kept
    /// for [`crate::backend::PagedDecoder::last_logits`].
    pub(super) fn read_out(
        &self,
        io: &StepIo,
        host: &HostRows,
        n: usize,
        picks: &[Pick],
    ) -> Result<Read, GpuError> {
        let (cl, vocab) = (&self.client, self.shape.vocab);
        if n == 0 {
            return Ok(Read { out: StepLogits::default(), kept: None });
        }
        let asked = |want: &dyn Fn(&Pick) -> bool| -> Vec<usize> {
            (0..n).filter(|&i| picks.get(i).is_some_and(want)).collect()
        };
        let device = self.device_pick;
        let (logits_of, topped, scored) = match device {
            true => (
                asked(&|p| *p == Pick::Logits),
                asked(&|p| match *p {
                    Pick::Top { .. } => true,
                    Pick::Scored { u, .. } => u < 0.0,
                    _ => false,
                }),
                asked(&|p| matches!(p, Pick::Scored { .. })),
            ),
            false => ((0..n).collect(), vec![], vec![]),
        };
        let scored_bufs = match (&io.adjust, scored.is_empty()) {
            (_, true) => None,
            (Some(a), false) => Some(a),
            (None, false) => return Err(GpuError::Unsupported("scored rows, no adjust".into())),
        };
        // Each scored row's additions, as the device holds them.
        let spans: Vec<_> = scored
            .iter()
            .map(|&i| host.adj_off[i] as usize..host.adj_off[i + 1] as usize)
            .collect();
        // Every row's logits as one range; else each asked run of rows.
        let all = logits_of.len() == n;
        let (rows_len, rows) = if all { (n * vocab, vec![0]) } else { (vocab, logits_of.clone()) };
        let p = &io.picked;
        let mut handles = vec![];
        let mut ends = vec![];
        let mut group = |h: Vec<_>| {
            handles.extend(h);
            ends.push(handles.len());
        };
        let known = device && (!topped.is_empty() || !scored.is_empty());
        group(if device { p.ids.row_ranges(n, &[0])? } else { vec![] });
        group(if known { p.chosen.row_ranges(n, &[0])? } else { vec![] });
        group(io.logits.row_ranges(rows_len, &rows)?);
        group(p.top.row_ranges(TOP_STRIDE, &topped)?);
        if let Some(a) = scored_bufs {
            group(a.scored.row_ranges(TOP_STRIDE, &scored)?);
            group(a.raw.ranges(&spans)?);
        }
        let bytes = cl.read(handles).map_err(GpuError::server)?;
        let part = |g: usize| &bytes[if g == 0 { 0 } else { ends[g - 1] }..ends[g]];
        let picked = device.then(|| DeviceBuf::<u32>::decode(part(0)));
        let chosen = DeviceBuf::<f32>::decode(part(1));
        let logits = DeviceBuf::<f32>::decode(part(2));
        // The picked token's logit, where it came back.
        let pick_of = |seq: usize| Some((picked.as_ref()?[seq], *chosen.get(seq)?));
        let k = vocab.min(TOP_N);
        let cands = |r: &[f32]| TopCandidates {
            cand: (0..k).map(|i| (r[i] as u32, r[TOP_N + i])).collect(),
            mass: r[2 * TOP_N],
            unit_mass: f64::from(r[2 * TOP_N + 1]),
            known: vec![],
        };
        let top = DeviceBuf::<f32>::decode(part(3));
        let tops = topped
            .iter()
            .zip(top.chunks_exact(TOP_STRIDE))
            .map(|(&seq, r)| {
                let mut c = cands(r);
                c.known.extend(pick_of(seq).filter(|(t, _)| c.logit(*t).is_none()));
                (seq, c)
            })
            .collect();
        let mut scored_out = vec![];
        if scored_bufs.is_some() {
            let sets = DeviceBuf::<f32>::decode(part(4));
            let raw = DeviceBuf::<f32>::decode(part(5));
            let mut raw = raw.as_slice();
            for ((&seq, r), span) in scored.iter().zip(sets.chunks_exact(TOP_STRIDE)).zip(&spans) {
                let mut c = cands(r);
                // Each added token's logit before its additions (a run of
                // additions to one token holds its logit at each).
                let (vals, rest) = raw.split_at(span.len().min(raw.len()));
                raw = rest;
                let ids = &host.adj_ids[span.clone()];
                for (&id, &l) in ids.iter().zip(vals) {
                    if c.known.last().is_none_or(|k| k.0 != id) {
                        c.known.push((id, l));
                    }
                }
                // The picked token's logit is its raw one unless it was added to.
                c.known.extend(pick_of(seq).filter(|(t, _)| !ids.contains(t)));
                scored_out.push((seq, c));
            }
        }
        // Any picked row may be read after the step: candidates that
        // missed, a pick outside a grammar's mask.
        let kept = device.then(|| io.logits.clone());
        let rows = (!all).then_some(logits_of);
        let out = StepLogits { logits, rows, picked, tops, scored: scored_out, adjusted: device };
        Ok(Read { out, kept })
    }
}
