//! A row's best logits, selected on the device for a top-k / top-p /
//! min-p draw that the host finishes (`sampling::Sampler::sample_top`):
//! 2 KB of candidates come back instead of the row's logits.

use cubecl::prelude::*;

/// Candidates selected per row: `sampling::TOP_CANDIDATES`, one per unit
/// of the picking cube ([`super::pick::PICK_THREADS`]) for the final sort.
pub const TOP_N: usize = 256;

/// Floats per row of the candidates' buffer: `TOP_N` ids (exact in f32:
/// vocabularies stay below 2²⁴), then their `TOP_N` logits, then the
/// row's mass at the draw's temperature and at 1 (`pick::pick_rows`).
pub const TOP_STRIDE: usize = 2 * TOP_N + 2;

/// Largest vocabulary whose ids the candidates carry exactly (f32) and
/// the id passes below cover (three bytes).
pub const TOP_MAX_VOCAB: usize = 1 << 24;

/// `f32`'s total order (the host's `total_cmp`) as `u32`'s: the sign bit
/// flipped for a positive value, every bit for a negative one.
#[cube]
fn order_key(v: f32) -> u32 {
    let b = u32::reinterpret(v);
    let flip = select(b >= 0x8000_0000u32, 0xFFFF_FFFFu32, 0x8000_0000u32);
    b ^ flip
}

/// Write the `min(TOP_N, vocab)` best logits of `logits[base..base +
/// vocab]` to `top[at..]`, best first, ties to the lower id (the host's
/// `sampling::top_candidates`): ids as f32 in `[at, at + TOP_N)`, the
/// logits from `at + TOP_N`. Every unit of a `TOP_N`-unit cube calls it.
///
/// A radix select over (logit's order key, then the id reversed): each
/// pass histograms one byte of the candidates still in contention into
/// 256 bins (shared atomics), a suffix sum finds the bin holding the last
/// one wanted, and the select ends as soon as that whole bin is wanted
/// (four key bytes, then up to three id bytes to split exact ties). The
/// selected are gathered in any order and placed by rank.
#[cube]
pub fn select_top(
    logits: &[f32],
    base: usize,
    vocab: usize,
    tid: usize,
    top: &mut [f32],
    at: usize,
) {
    let hist = Shared::<[Atomic<u32>]>::new_slice(TOP_N);
    let mut sfx = Shared::<[u32]>::new_slice(TOP_N);
    // Key prefix and mask, id prefix and mask, how many still wanted,
    // whether the select is settled.
    let mut st = Shared::<[u32]>::new_slice(6usize);
    let k = select(vocab < TOP_N, vocab, TOP_N);
    if tid == 0 {
        st[0] = 0u32;
        st[1] = 0u32;
        st[2] = 0u32;
        st[3] = 0u32;
        st[4] = k as u32;
        st[5] = 0u32;
    }
    sync_cube();
    let mut pass = 0u32.runtime();
    // Seven passes settle it at the latest (the last leaves one id); the
    // bound only keeps a fault from spinning.
    while st[5] == 0u32 && pass < 7u32 {
        hist[tid].store(0u32);
        sync_cube();
        let (kp, km, ip, im) = (st[0], st[1], st[2], st[3]);
        // This pass's byte: of the key, then of the id (each shift taken
        // in range; the other one's value is not used).
        let of_key = pass < 4u32;
        let ks = select(of_key, 24u32 - 8u32 * pass, 0u32);
        let is = select(of_key, 0u32, 16u32 - 8u32 * (pass - 4u32));
        let mut i = tid;
        while i < vocab {
            let key = order_key(logits[base + i]);
            let id = i as u32;
            let live = select(of_key, (key & km) == kp, key == kp && (id & im) == ip);
            // The lower id is the better: its byte reversed.
            let d = select(of_key, (key >> ks) & 255u32, 255u32 - ((id >> is) & 255u32));
            if live {
                hist[d as usize].fetch_add(1u32);
            }
            i += TOP_N;
        }
        sync_cube();
        sfx[tid] = hist[tid].load();
        sync_cube();
        // sfx[b] = the count in bins b and above.
        let mut off = 1usize.runtime();
        while off < TOP_N {
            let mut add = 0u32;
            if tid + off < TOP_N {
                add = sfx[tid + off];
            }
            sync_cube();
            sfx[tid] += add;
            sync_cube();
            off *= 2;
        }
        let want = st[4];
        let incl = sfx[tid];
        let mut above = 0u32;
        if tid + 1 < TOP_N {
            above = sfx[tid + 1];
        }
        // Every unit has read `want` before one unit changes it.
        sync_cube();
        // Exactly one bin holds the last one wanted.
        if above < want && want <= incl {
            let b = tid as u32;
            if pass < 4u32 {
                let s = 24u32 - 8u32 * pass;
                st[0] = kp | (b << s);
                st[1] = km | (255u32 << s);
            } else {
                let s = 16u32 - 8u32 * (pass - 4u32);
                st[2] = ip | ((255u32 - b) << s);
                st[3] = im | (255u32 << s);
            }
            st[4] = want - above;
            st[5] = select(incl - above == want - above, 1u32, 0u32);
        }
        sync_cube();
        pass += 1u32;
    }
    // Gather: every key above the prefix, and those in it (with the id
    // prefix: the lower ids).
    let count = Shared::<[Atomic<u32>]>::new_slice(1usize);
    let mut cid = Shared::<[u32]>::new_slice(TOP_N);
    let mut ckey = Shared::<[u32]>::new_slice(TOP_N);
    if tid == 0 {
        count[0].store(0u32);
    }
    sync_cube();
    let (kp, km, ip, im) = (st[0], st[1], st[2], st[3]);
    let mut i = tid;
    while i < vocab {
        let key = order_key(logits[base + i]);
        let id = i as u32;
        let by_id = key > kp || (key == kp && (id & im) <= ip);
        if select(im == 0u32, (key & km) >= kp, by_id) {
            let s = count[0].fetch_add(1u32) as usize;
            if s < TOP_N {
                cid[s] = id;
                ckey[s] = key;
            }
        }
        i += TOP_N;
    }
    sync_cube();
    // Each selected one's place: how many are better.
    if tid < k {
        let (mk, mi) = (ckey[tid], cid[tid]);
        let mut r = 0usize.runtime();
        for j in 0..k {
            let (ok, oi) = (ckey[j], cid[j]);
            if ok > mk || (ok == mk && oi < mi) {
                r += 1;
            }
        }
        top[at + r] = f32::cast_from(mi);
        top[at + TOP_N + r] = logits[base + mi as usize];
    }
}
