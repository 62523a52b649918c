//! A paged forward step's rows as flat host arrays: what a GPU decoder
//! uploads (or, for a replayed graph, writes into its bucket) per step.

use super::{Adjust, Pick};

/// Floats of [`HostRows::pick`] a sequence (the GPU kernel's
/// `pick::PICK_STRIDE`).
pub const PICK_STRIDE: usize = 4;
use crate::llama::PagedSeq;
use crate::paged::BLOCK_SIZE as BLOCK;

/// A step's per-row inputs on the host.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct HostRows {
    pub tokens: Vec<u32>,
    /// Each row's position.
    pub pos: Vec<u32>,
    /// Each row's K/V slot: `block · 16 + pos % 16`.
    pub slot: Vec<u32>,
    /// Offset of each row's block table in `tables`.
    pub table: Vec<u32>,
    /// The sequences' block tables, one after another.
    pub tables: Vec<u32>,
    /// Each sequence's last row (whose logits come back).
    pub last: Vec<u32>,
    /// 1 where a row takes the single-row (decode) order of the CPU's
    /// attention: its position is at or past its sequence's `decode_from`
    /// (`attn::PagedSeqRef::decode_from`).
    pub single: Vec<u32>,
    /// Each sequence's `[temperature, uniform, candidates, scored]`:
    /// temperature 0 picks its argmax, a positive one draws at a uniform
    /// `>= 0` (its argmax below 0); `candidates` 1 also selects the row's
    /// best candidates, `scored` 1 those of its row before its additions
    /// ([`Pick`]).
    pub pick: Vec<f32>,
    /// Each sequence's bias and penalty additions
    /// (`adj_ids`/`adj_adds[adj_off[i]..adj_off[i + 1]]`, [`Adjust`]): one
    /// offset more than sequences.
    pub adj_off: Vec<u32>,
    pub adj_ids: Vec<u32>,
    pub adj_adds: Vec<f32>,
    /// Each sequence's grammar mask
    /// (`mask_words[mask_off[i]..mask_off[i + 1]]`, empty: none).
    pub mask_off: Vec<u32>,
    pub mask_words: Vec<u32>,
}

impl HostRows {
    /// The rows of `seqs`, each sequence's new tokens in order.
    pub fn new(seqs: &[PagedSeq<'_>]) -> Self {
        let mut r = HostRows::default();
        for s in seqs {
            let toff = r.tables.len() as u32;
            r.tables.extend_from_slice(s.table);
            for (i, &tok) in s.tokens.iter().enumerate() {
                let p = s.past + i;
                r.tokens.push(tok);
                r.pos.push(p as u32);
                r.slot.push(s.table[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32);
                r.table.push(toff);
                r.single.push(u32::from(p >= s.decode_from));
            }
            r.last.push(r.tokens.len() as u32 - 1);
            r.pick.extend([0.0; PICK_STRIDE]);
        }
        r.adj_off = vec![0; seqs.len() + 1];
        r.mask_off = vec![0; seqs.len() + 1];
        r
    }

    /// Each sequence's masks and additions of `adjust`, but those of a
    /// sequence whose logits come back ([`Pick::Logits`]: the host applies
    /// them); a mask's words past `mask_words` (a row's logits) dropped.
    pub fn set_adjust(&mut self, adjust: &Adjust, picks: &[Pick], mask_words: usize) {
        let n = self.last.len();
        self.adj_ids.clear();
        self.adj_adds.clear();
        self.mask_words.clear();
        (self.adj_off, self.mask_off) = (vec![0], vec![0]);
        for i in 0..n {
            if picks.get(i).is_some_and(|p| *p != Pick::Logits) {
                let r = adjust.range(i);
                self.adj_ids.extend_from_slice(&adjust.ids()[r.clone()]);
                self.adj_adds.extend_from_slice(&adjust.adds()[r]);
                let m = adjust.mask_range(i);
                let m = m.start..m.end.min(m.start + mask_words);
                self.mask_words.extend_from_slice(&adjust.mask_words()[m]);
            }
            self.adj_off.push(self.adj_ids.len() as u32);
            self.mask_off.push(self.mask_words.len() as u32);
        }
    }

    /// Each sequence's pick (one per sequence, in order); the argmax for
    /// those not given.
    pub fn set_picks(&mut self, picks: &[Pick]) {
        for (p, pick) in self.pick.chunks_exact_mut(PICK_STRIDE).zip(picks) {
            p.copy_from_slice(&match *pick {
                Pick::Draw { temperature, u } => [temperature, u, 0.0, 0.0],
                Pick::Top { temperature, u } => [temperature, u, 1.0, 0.0],
                // The adjusted row's candidates only for the host's draw.
                Pick::Scored { temperature, u } => {
                    [temperature, u, f32::from(u8::from(u < 0.0)), 1.0]
                }
                Pick::Logits | Pick::Argmax => [0.0; PICK_STRIDE],
            });
        }
    }

    /// Some sequence asks for candidates before its additions
    /// ([`Pick::Scored`]).
    pub fn scores(&self) -> bool {
        self.pick.chunks_exact(PICK_STRIDE).any(|p| p[3] > 0.0)
    }

    /// Pad a decode step (one row per sequence) to `rows` rows. A padding
    /// row is token 0 at position 0 in `scratch`, a block no sequence
    /// owns, so it writes and reads nothing of theirs; its logits are
    /// dropped. Only the tables in use are written to the bucket's buffer
    /// (its tail, left from earlier steps, is read by no row).
    pub fn pad_decode(&mut self, rows: usize, scratch: u32) {
        debug_assert_eq!(self.tokens.len(), self.last.len(), "decode rows only");
        let at = self.tables.len() as u32;
        self.tables.push(scratch);
        for i in self.tokens.len()..rows {
            self.tokens.push(0);
            self.pos.push(0);
            self.slot.push(scratch * BLOCK as u32);
            self.table.push(at);
            self.single.push(1);
            self.last.push(i as u32);
            self.pick.extend([0.0; PICK_STRIDE]);
            self.adj_off.push(self.adj_ids.len() as u32);
            self.mask_off.push(self.mask_words.len() as u32);
        }
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_block_tables() {
        let (a, b) = ([5u32, 6, 7], [9u32]);
        let seqs = [
            PagedSeq { tokens: &a, past: 14, table: &[3, 4], decode_from: 0 },
            PagedSeq { tokens: &b, past: 0, table: &[8], decode_from: 0 },
        ];
        let r = HostRows::new(&seqs);
        assert_eq!(r.tokens, vec![5, 6, 7, 9]);
        assert_eq!(r.pos, vec![14, 15, 16, 0]);
        // Positions 14, 15 in block 3; 16 is the first of block 4.
        assert_eq!(r.slot, vec![3 * 16 + 14, 3 * 16 + 15, 4 * 16, 8 * 16]);
        assert_eq!(r.table, vec![0, 0, 0, 2]);
        assert_eq!(r.tables, vec![3, 4, 8]);
        assert_eq!(r.last, vec![2, 3]);
        assert_eq!(r.single, vec![1, 1, 1, 1], "decode_from 0: every row");
        let seqs = [PagedSeq { tokens: &a, past: 14, table: &[3, 4], decode_from: 15 }];
        assert_eq!(HostRows::new(&seqs).single, vec![0, 1, 1]);
    }

    #[test]
    fn decode_padding_rows_touch_only_the_scratch_block() {
        let (a, b) = ([5u32], [9u32]);
        let seqs = [
            PagedSeq { tokens: &a, past: 20, table: &[3, 4], decode_from: 0 },
            PagedSeq { tokens: &b, past: 3, table: &[8], decode_from: 0 },
        ];
        let mut r = HostRows::new(&seqs);
        r.pad_decode(4, 99);
        assert_eq!(r.rows(), 4);
        assert_eq!(r.tokens, vec![5, 9, 0, 0]);
        assert_eq!(r.pos, vec![20, 3, 0, 0]);
        assert_eq!(r.slot, vec![4 * 16 + 4, 8 * 16 + 3, 99 * 16, 99 * 16]);
        // The padding rows' table is the one scratch entry after the real ones.
        assert_eq!(r.table, vec![0, 2, 3, 3]);
        assert_eq!(r.tables, vec![3, 4, 8, 99]);
        assert_eq!(r.last, vec![0, 1, 2, 3]);
        assert_eq!(r.single, vec![1, 1, 1, 1]);
        assert_eq!(r.pick, vec![0.0; 16], "padding rows pick their argmax");
        assert_eq!((r.adj_off, r.mask_off), (vec![0; 5], vec![0; 5]), "and add nothing");
    }

    #[test]
    fn a_draw_carries_its_temperature_and_uniform_and_the_rest_their_argmax() {
        let (a, b, c) = ([5u32], [9u32], [7u32]);
        let seqs = [
            PagedSeq { tokens: &a, past: 0, table: &[1], decode_from: 0 },
            PagedSeq { tokens: &b, past: 0, table: &[2], decode_from: 0 },
            PagedSeq { tokens: &c, past: 0, table: &[3], decode_from: 0 },
        ];
        let mut r = HostRows::new(&seqs);
        r.set_picks(&[Pick::Logits, Pick::Draw { temperature: 0.7, u: 0.25 }, Pick::Argmax]);
        assert_eq!(r.pick, [[0.0; 4], [0.7, 0.25, 0.0, 0.0], [0.0; 4]].concat());
        assert!(!r.scores());
        r.set_picks(&[Pick::Top { temperature: 0.9, u: -1.0 }]);
        assert_eq!(&r.pick[..4], &[0.9, -1.0, 1.0, 0.0]);
        // Scored: the adjusted row's candidates only for the host's draw.
        let scored = |temperature, u| Pick::Scored { temperature, u };
        r.set_picks(&[scored(0.0, 0.0), scored(0.8, 0.5), scored(0.9, -1.0)]);
        assert_eq!(
            r.pick,
            [[0.0, 0.0, 0.0, 1.0], [0.8, 0.5, 0.0, 1.0], [0.9, -1.0, 1.0, 1.0]].concat()
        );
        assert!(r.scores());
    }

    /// A step's masks and additions, each sequence's additions grouped by
    /// id in its order; a row whose logits come back gets neither (the
    /// host applies them), nor do a decode bucket's padding rows.
    #[test]
    fn additions_follow_their_sequences_but_those_of_rows_read_back() {
        let (a, b, c) = ([5u32], [9u32], [7u32]);
        let seqs = [
            PagedSeq { tokens: &a, past: 0, table: &[1], decode_from: 0 },
            PagedSeq { tokens: &b, past: 0, table: &[2], decode_from: 0 },
            PagedSeq { tokens: &c, past: 0, table: &[3], decode_from: 0 },
        ];
        let adds: [&[(u32, f32)]; 3] =
            [&[(4, 1.0), (2, -0.5), (4, 2.0)], &[(8, 3.0)], &[(1, -1.0), (0, 0.25)]];
        let masks: [Option<&[u32]>; 3] = [None, Some(&[7, 8]), Some(&[1, 2, 3, 4])];
        let adjust = Adjust::new(adds).with_masks(masks);
        assert_eq!(adjust.ids(), &[2, 4, 4, 8, 0, 1]);
        assert_eq!(adjust.adds(), &[-0.5, 1.0, 2.0, 3.0, 0.25, -1.0]);
        assert_eq!((adjust.range(1), adjust.range(3)), (3..4, 0..0));
        assert_eq!((adjust.mask_range(0), adjust.mask_range(2)), (0..0, 2..6));
        let mut r = HostRows::new(&seqs);
        assert_eq!((&r.adj_off, &r.mask_off), (&vec![0; 4], &vec![0; 4]));
        let picks = [Pick::Argmax, Pick::Logits, Pick::Draw { temperature: 1.0, u: 0.5 }];
        r.set_adjust(&adjust, &picks, 3);
        assert_eq!(r.adj_off, vec![0, 3, 3, 5]);
        assert_eq!(r.adj_ids, vec![2, 4, 4, 0, 1]);
        assert_eq!(r.adj_adds, vec![-0.5, 1.0, 2.0, 0.25, -1.0]);
        // Row 1's mask is the host's; row 2's cut to a row's 3 words.
        assert_eq!((&r.mask_off, &r.mask_words), (&vec![0, 0, 0, 3], &vec![1, 2, 3]));
        r.pad_decode(4, 99);
        assert_eq!((r.adj_off, r.mask_off), (vec![0, 3, 3, 5, 5], vec![0, 0, 0, 3, 3]));
        assert!(Adjust::default().is_empty() && Adjust::default().range(0).is_empty());
        // An empty mask allows nothing (a word of zeros), unlike no mask.
        let none: [Option<&[u32]>; 2] = [Some(&[]), None];
        let a = Adjust::new([&[][..], &[]]).with_masks(none);
        assert_eq!((a.mask_words(), a.touches(0), a.touches(1)), (&[0][..], true, false));
    }
}
